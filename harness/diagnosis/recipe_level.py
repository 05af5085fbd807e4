"""The recipe-level diagnosis: the one cause that explains every failing case of a recipe, or which cases disagree.

A wrong recipe fails in many cases (scenarios, world sizes, precisions, strategies, meshes), each read on its own
window. A case's own reading can be true and still not be the recipe's cause: on a window where one rank holds every
token, a mean of local means *is* a common scale, and the case reads ``global_scale``; where every rank has one
microbatch, a mean per microbatch is a mean of local means. The recipe has one mistake; its cases' readings are views
of it through their counts.

So each case is kept with every hypothesis it is consistent with (:class:`Case`): its own reading, the readings its
counts cannot tell it from (the signature's ``alternatives``), and each catalog pattern whose predicted weights fit
the case's fitted weights at scale 1 within the match tolerance (the diagnosis's ``fits``, computed on the case's own
blocks: :func:`harness.diagnosis.signatures.patterns`). A case that failed for a reason that is not a weighting (a sync
count, a crash, a hang) is consistent with its own reading only. The recipe's cause is a hypothesis every case is
consistent with (:func:`recipe_reading`); the one most cases read as their own leads. Where none is, the hypothesis
that explains the most cases is named with the cases that disagree and why (their weights miss its prediction by a
measured deviation, or they failed in a way it does not predict).

A drawn layout (the battery's shrunk random layouts, ``scenario == "drawn"``) is read on a handful of tokens whose
counts coincide more often: it may only narrow the reading of the scenario cases, never contradict it. Where its
readings share no hypothesis with theirs it is said beside, not held against them.

Pure: it reads plain values (a verdict's fields and its diagnosis's JSON), so every surface (the command line, pytest,
rank 0 under torchrun, ``explain``) states the same reading.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from harness.diagnosis import positions
from harness.diagnosis.fit import Block, Fit, explained_residual, match_tolerance
from harness.diagnosis.positions import POSITION
from harness.diagnosis.signature_catalog import SIGNATURES
from harness.diagnosis.signatures import patterns, scale_fit

DRAWN = "drawn"


@dataclass(frozen=True)
class Case:
    """One failing case of a recipe, as the recipe-level reading weighs it."""

    label: str
    """Where it failed (``"parity (uneven, W=3, fp32)"``)."""
    check: str
    reading: str
    """Its own reading: the diagnosis's signature, else the check's finding, else how the run failed, else
    ``"<check> numbers"`` (the check's own comparison, no reading of its own)."""
    consistent: frozenset[str]
    """Every hypothesis it is consistent with (its own reading among them)."""
    deviations: Mapping[str, float] = field(default_factory=dict)
    """Each catalog pattern's deviation from its fitted weights in match tolerances (``inf``: the scale is not 1)."""
    sentence: str = ""
    fix: str | None = None
    drawn: bool = False
    note: str | None = None
    """Why a case that failed otherwise than by its weights is consistent with more than its own reading."""
    implied: frozenset[str] = frozenset()
    """The hypotheses ``note`` makes it consistent with: they may explain it, never lead beside its own reading."""
    coarse: bool = False
    """Read to a coarse lane's bound (the bf16 lane) where it names nothing (``unexplained``): a cause below that bound
    leaves it so, and it does not decide."""
    profile: Mapping[str, float] | None = None
    """Its weights per position class (:mod:`harness.diagnosis.positions`), where they are one per class."""
    companions: tuple[str, ...] = ()
    """Readings of a linked check in the same case (the clipping check's finding beside a clipping run's parity):
    the same mistake seen by two checks, each consistent with the other's reading."""

    @property
    def read(self) -> bool:
        """Whether it has a reading of its own: a case that only failed its check's comparison (a logged loss off, ranks
        that disagree) is a consequence, consistent with any cause, and never decides it."""
        return not self.reading.endswith(NUMBERS) and self.reading not in ELSEWHERE and not self.coarse


NUMBERS = " numbers"
"""How a case with no reading of its own is named: ``"logged_loss numbers"``."""

ELSEWHERE = frozenset({"started_elsewhere"})
"""Readings that send the reader to another window (its weights were moved by an earlier window's wrong step): the
case is that window's consequence, not a reading of its own."""


def pattern_fits(blocks: Sequence[Block], fit: Fit, world_size: int) -> tuple[tuple[str, float, float], ...]:
    """Each catalog pattern's ``(name, best scale c, deviation of its prediction at scale 1)`` on a microbatch fit
    whose ratios are read against ``1/N`` (``patterns``' world is the token group's). The deviation is the largest
    ``|q - p|`` over the largest ``|p|``, in match tolerances at the accuracy the fit was read to (the bf16 lane's is
    coarser: :func:`harness.diagnosis.fit.accuracy`). The token mean's own pattern fitting at a scale other than 1 is
    ``global_scale`` (its deviation at that scale). None when the fit explains too little to be read as weights."""
    n = sum(b.tokens for b in blocks)
    if n <= 0 or fit.residual > explained_residual():
        return ()
    q = [float(w) * n for w in fit.weights]
    tol = match_tolerance()
    out = []
    for name, p in patterns(blocks, world_size).items():
        c, dev = scale_fit(q, p)
        pairs = [(a, b) for a, b in zip(q, p) if math.isfinite(a) and math.isfinite(b)]
        top = max((abs(b) for _, b in pairs), default=0.0)
        if not (math.isfinite(c) and math.isfinite(dev)) or top == 0:
            continue
        at_one = max(abs(a - b) for a, b in pairs) / top
        if name == "correct" and abs(c - 1) > tol:
            out.append(("global_scale", c, dev / tol))  # every weight c/N: the scale is the hypothesis
        out.append((name, c, at_one / tol))
    return tuple(out)


def consistent_set(reading: str, diagnosis: Mapping[str, object] | None) -> tuple[frozenset[str], dict[str, float]]:
    """The hypotheses a case reading ``reading`` (with its diagnosis's JSON, if any) is consistent with: its own,
    the readings its counts cannot tell from it, and each pattern whose prediction fits its weights; and each fitted
    pattern's deviation in match tolerances."""
    found = {reading}
    deviations: dict[str, float] = {}
    if diagnosis:
        found.update(str(a) for a in diagnosis.get("alternatives") or ())  # type: ignore[attr-defined]
        found.update(_same_here(reading, diagnosis.get("weights") or ()))  # type: ignore[arg-type]
        for name, _, dev in diagnosis.get("fits") or ():  # type: ignore[attr-defined]
            if dev is None:
                continue
            deviations[str(name)] = float(dev)
            if float(dev) <= 1 and name != "correct":  # a right weighting is no cause of a failing case
                found.add(str(name))
    return frozenset(found), deviations


PER_RANK = ("mean_of_local_means", "per_microbatch_mean")
"""Readings that are one where every rank has one microbatch: a mean per microbatch is then a mean per rank."""

AUXILIARY_PER_RANK = ("auxiliary_summed_over_ranks", "auxiliary_misweighted")
"""An auxiliary term's readings that are one where every rank has one microbatch: a factor ``W * k`` (a term
multiplied by W and never divided by k, ``Trainer``'s on a transformers MoE model's router loss) is then ``W``."""

AUXILIARY_ONE_RANK = ("auxiliary_not_divided_by_k", "auxiliary_misweighted")
"""An auxiliary term's readings that are one where the window has one rank: a factor ``W * k`` is then ``k``."""

FREE_PER_RANK = ("per_rank_normalizer", "subgroup_count", "count_group")
"""Readings that give each rank (or group of ranks) a factor of its own, free of the window's counts: where one rank
holds every token, any of them is a common scale."""


def _same_here(reading: str, weights: Sequence[Mapping[str, object]]) -> set[str]:
    """The readings this window's shape makes one with ``reading``: where every rank has one microbatch, a mean per
    microbatch and a mean per rank, and an auxiliary term's factor W and W * k; where the window has one rank, an
    auxiliary term's factor k and W * k; where one rank holds every token, a scale and a factor per rank."""
    ranks: dict[int, set[int]] = {}
    holding = set()
    for w in weights:
        rank = int(w["rank"])  # type: ignore[call-overload]
        ranks.setdefault(rank, set()).add(int(w["microbatch"]))  # type: ignore[call-overload]
        if w.get("tokens"):
            holding.add(rank)
    out: set[str] = set()
    if reading in PER_RANK and ranks and all(len(m) == 1 for m in ranks.values()):
        out.update(PER_RANK)
    if reading == AUXILIARY_PER_RANK[0] and ranks and all(len(m) == 1 for m in ranks.values()):
        out.update(AUXILIARY_PER_RANK)
    if reading == AUXILIARY_ONE_RANK[0] and len(ranks) == 1:
        out.update(AUXILIARY_ONE_RANK)
    if reading == "global_scale" and len(holding) == 1:
        out.update(FREE_PER_RANK)
    return out


@dataclass(frozen=True)
class RecipeReading:
    """What the recipe's failing cases say together."""

    cases: tuple[Case, ...]
    cause: str | None
    """The hypothesis every deciding case is consistent with; None: none is, or nothing failed."""
    lead: str | None
    """The hypothesis that explains the most deciding cases (the cause where there is one)."""
    also: tuple[str, ...] = ()
    """Other hypotheses every deciding case is consistent with: these cases cannot tell them from the cause."""
    detail: str | None = None
    """The cause's sentence where no case states it (a hypothesis of the recipe level alone: the positions)."""

    @property
    def deciding(self) -> list[Case]:
        """The scenario cases with a reading of their own (every case with a reading where none has one, so that a
        recipe failing only a check's comparison is read by that check)."""
        scenario = [c for c in self.cases if not c.drawn] or list(self.cases)
        return [c for c in scenario if c.read] or scenario

    def explained(self) -> list[Case]:
        return [c for c in self.deciding if self.lead in _hypotheses(c)]

    def disagreeing(self) -> list[Case]:
        return [c for c in self.deciding if self.lead not in _hypotheses(c)]

    def lines(self, title: str | None = None) -> list[str]:
        """The reading in words: the cause, where it holds, its sentence and fix; or the lead and the cases that
        disagree, grouped by their own reading, each with why. Then the consequences and the drawn layouts' aside."""
        if not self.cases or self.lead is None:
            return []
        who = f"{title}: " if title else ""
        held = self.explained()
        rep = _representative(held, self.lead)
        if self.cause is not None:
            n = len(held)
            head = (f"{who}recipe-level diagnosis ({self.cause}): one cause explains "
                    f"{'the' if n == 1 else f'all {n}'} failing case{'' if n == 1 else 's'} with a reading "
                    f"({_where(held)})")
            own = _own_counts(held)
            if set(own) != {self.cause}:  # the cases' own readings, where some read it otherwise on their windows
                head += "; read on their own windows as " + ", ".join(f"{r} in {n}" for r, n in own.items())
            if self.also:
                head += f"; these cases cannot tell it from {', '.join(self.also)}"
            out = [head, f"  {self.detail or rep.sentence or SIGNATURES.get(self.cause, self.cause)}"]
        else:
            out = [f"{who}recipe-level diagnosis: no one cause explains every failing case; {self.lead} explains "
                   f"{len(held)} of {len(self.deciding)} ({_where(held)})",
                   f"  {rep.sentence or SIGNATURES.get(self.lead, self.lead)}"]
            by_reading: dict[str, list[Case]] = {}
            for c in self.disagreeing():
                by_reading.setdefault(c.reading, []).append(c)
            for reading, cases in by_reading.items():
                out.append(f"  {len(cases)} disagree{'s' if len(cases) == 1 else ''}, reading {reading} "
                           f"({_where(cases)}): {_why(cases, self.lead)}")
        notes = dict.fromkeys(c.note for c in held if c.note and c.reading != self.lead)
        out += [f"  {n}" for n in notes if n]
        linked = sorted({r for c in held for r in c.companions if r != self.lead})
        if linked:
            out.append(f"  the same cases' other checks read {', '.join(linked)}: the same mistake seen by each")
        after = [c for c in self.cases if not c.read and not c.drawn and c not in self.deciding]
        compared = [c for c in after if c.reading not in ELSEWHERE and not c.coarse]
        moved = [c for c in after if c.reading in ELSEWHERE]
        coarse = [c for c in after if c.coarse]
        if coarse:
            out.append(f"  also failing ({_where(coarse)}): read to the bf16 lane's bound, where they name nothing: "
                       "the cause is finer than that bound there")
        if compared:
            out.append(f"  also failing, as its consequence ({_where(compared)}): their checks' comparisons, with no "
                       "reading of their own")
        if moved:
            out.append(f"  also failing, as its consequence ({_where(moved)}): windows read at weights an earlier "
                       "window's wrong step moved (started_elsewhere)")
        aside = [c for c in self.cases if c.drawn and c.read and self.lead not in _hypotheses(c)]
        if aside:
            out.append(f"  the drawn layouts read {_readings(aside)} on their few tokens: a shrunk layout's counts "
                       "coincide more often, so they may narrow this reading and never contradict it")
        fix = positions.FIX if self.lead == POSITION else rep.fix
        if fix:
            out.append(f"  fix: {fix}")
        return out


def _hypotheses(c: Case) -> frozenset[str]:
    return c.consistent | frozenset(c.companions)


def recipe_reading(cases: Iterable[Case]) -> RecipeReading:
    """The recipe-level reading of ``cases`` (every failing case of one recipe)."""
    cases = tuple(cases)
    if not cases:
        return RecipeReading((), None, None)
    deciding = RecipeReading(cases, None, None).deciding
    base = frozenset.intersection(*(_hypotheses(c) for c in deciding))
    narrowed, narrowing = base, []
    for c in cases:
        if c.drawn and c.read and narrowed & _hypotheses(c):
            narrowed = narrowed & _hypotheses(c)  # a drawn layout only narrows
            narrowing.append(c)
    own = _own_counts(deciding)
    common, merged = _settle(narrowed, [*deciding, *narrowing])
    if not common:  # what the drawn layouts narrowed to does not hold: they never contradict the scenario cases
        common, merged = _settle(base, deciding)
    if common:
        ranked = sorted(common, key=lambda h: _rank(h, own))
        linked = {r for c in deciding for r in c.companions}
        # The positions' hypothesis stands in only where nothing more specific holds: never named beside a cause.
        also = tuple(h for h in ranked[1:] if h not in linked and h != POSITION
                     and not all(h in c.implied for c in deciding))
        detail = positions.describe(merged) if ranked[0] == POSITION and merged else None
        return RecipeReading(cases, ranked[0], ranked[0], also, detail)
    every = sorted({h for c in deciding for h in _hypotheses(c)} - {POSITION}, key=lambda h: _rank(h, own))
    lead = max(every, key=lambda h: sum(h in _hypotheses(c) for c in deciding))
    return RecipeReading(cases, None, lead)


def _settle(common: frozenset[str], cases: Sequence[Case]) -> tuple[frozenset[str], dict[str, float] | None]:
    """``common`` without the positions' hypothesis where the cases' profiles do not merge into one that weighs
    positions differently (one weight on every position is a common scale, read as such), and the merged profile."""
    merged = positions.merge(c.profile for c in cases if c.read) if POSITION in common else None
    if not positions.names_a_position(merged):
        return common - {POSITION}, None
    return common, merged


def _own_counts(cases: Sequence[Case]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in cases:
        out[c.reading] = out.get(c.reading, 0) + 1
    return out


_ORDER = {name: i for i, name in enumerate(SIGNATURES)}


def _rank(h: str, own: Mapping[str, int]) -> tuple[int, int, int, str]:
    """The lead among hypotheses every case fits: the one most cases read as their own, then a catalog signature
    before another reading, a specific one before ``global_scale`` and ``unexplained``, then the catalog's order."""
    vague = h in ("global_scale", "unexplained", "extra_term", POSITION)
    return (-own.get(h, 0), int(vague), _ORDER.get(h, len(_ORDER)), h)


def _representative(cases: Sequence[Case], hypothesis: str) -> Case:
    """The case whose own reading is the hypothesis (its sentence and fix are the recipe's); for a hypothesis that is
    a check's name (two linked checks' shared one), that check's first case with a reading."""
    for c in cases:
        if c.reading == hypothesis:
            return c
    for c in cases:
        if c.check == hypothesis and c.read:
            return c
    return cases[0]


def _readings(cases: Sequence[Case]) -> str:
    return ", ".join(dict.fromkeys(c.reading for c in cases))


def _where(cases: Sequence[Case]) -> str:
    """How many cases of which checks: ``parity in 12, one_sync in 2``."""
    by: dict[str, int] = {}
    for c in cases:
        by[c.check] = by.get(c.check, 0) + 1
    return ", ".join(f"{check} in {n}" for check, n in by.items())


def _why(cases: Sequence[Case], lead: str) -> str:
    """Why cases do not fit the lead: their weights' measured miss, or a failure the lead does not predict."""
    misses = [c.deviations[lead] for c in cases if lead in c.deviations]
    label = cases[0].label
    if misses:
        span = f"{min(misses):.3g}" if min(misses) == max(misses) else f"{min(misses):.3g} to {max(misses):.3g}"
        return f"their weights miss {lead}'s prediction by {span} times the tolerance a match allows, e.g. {label}"
    if lead in _ORDER and cases[0].reading not in _ORDER:
        return (f"a failure of another kind than a weighting ({cases[0].reading}), which {lead} does not predict, "
                f"e.g. {label}")
    return f"read on their own windows as another cause, e.g. {label}"


__all__ = ["DRAWN", "NUMBERS", "Case", "RecipeReading", "consistent_set", "pattern_fits", "recipe_reading"]
