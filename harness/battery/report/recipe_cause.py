"""The battery's verdicts as the recipe-level diagnosis reads them (:mod:`harness.diagnosis.recipe_level`): each
failing verdict is a :class:`~harness.diagnosis.recipe_level.Case` (its own reading, its diagnosis's alternatives and
pattern fits), and each recipe's failing cases give one reading, which the last screen leads with."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from harness.battery.judge.verdict import FAIL, Verdict
from harness.battery.report.table import row_label
from harness.battery.report.zero_counts import LOCAL_COUNTS, local_count_is_zero
from harness.diagnosis.positions import POSITION, position_profile
from harness.diagnosis.recipe_level import DRAWN, NUMBERS, Case, RecipeReading, consistent_set, recipe_reading

LINKED = (frozenset({"parity", "clipping"}),)
"""Checks that see one mistake from two sides in the same case: a clip taken by the wrong norm is the clipping check's
finding and, through the factor it applied, the parity reading of the same gradient."""

CLIP = "clipping"
"""The hypothesis two linked clipping cases share whatever each reads: the clip's norm or factor is wrong (the
clipping check fails in the same case as parity). Its finding, where the check names one, says which."""

CLIPPED = frozenset({"clipping_not_applied", "clipped_by_wrong_norm"})
"""Parity readings that name the clip: each is one view of a wrong clip, whatever the clipping check said there. A
gradient through an engaged clip that no weighting explains (``unexplained``, an extra term, a scale) is one too."""

OWN_SPLIT = "dynamic_microbatch_mean"
"""Each micro-batch of a rank's own re-split (a token budget) weighing 1/(W * K_r). Where a recipe's cases read it,
its cases reading a mean per rank or per microbatch are that split where it fell on the rank (K_r = 1) or on the
window's microbatches: they may be explained by it (:attr:`~harness.diagnosis.recipe_level.Case.implied`). Where none
reads it, a mean per rank in one case and per microbatch in another stay apart."""

SPLIT_VIEWS = frozenset({"mean_of_local_means", "per_microbatch_mean"})

RUN_FAILURES = frozenset({"desync", "crash", "died", "deadline", "refused"})
"""How a run itself failed: every check of that run fails the same way, and counts once."""


def own_reading(v: Verdict) -> str:
    """A failing verdict's own reading: its diagnosis's signature (its finding where the weighting reads right: a
    float32 computation in the float64 lane), else its finding, else how the run failed, else
    the check's own comparison (``"<check> numbers"``)."""
    signature = str((v.diagnosis or {}).get("signature") or "")
    if signature and not (v.finding and signature == "correct"):  # a right weighting the check failed: its finding
        return signature
    if v.finding:
        return v.finding
    if v.cause not in (None, "numbers"):
        return str(v.cause)
    return f"{v.check}{NUMBERS}"


def _key(v: Verdict) -> tuple[object, ...]:
    """The case a verdict judges, whatever its check."""
    return (v.label, v.scenario, v.world_size, v.precision, v.strategy, v.mesh)


def case_of(v: Verdict, companions: tuple[str, ...] = ()) -> Case:
    reading = own_reading(v)
    consistent, deviations = consistent_set(reading, v.diagnosis)
    diagnosis = v.diagnosis or {}
    profile = position_profile(diagnosis.get("weights") or ())  # type: ignore[arg-type]
    if profile is not None:
        consistent = consistent | {POSITION}
    implied: set[str] = set()
    through = bool(diagnosis.get("clipped")) and reading in ("unexplained", "extra_term", "global_scale")
    if reading in CLIPPED or through or (v.check == CLIP and not reading.endswith(NUMBERS)):
        consistent, implied = consistent | {CLIP}, implied | {CLIP}  # a view of the clip, named by its own reading
    note = None
    if v.cause in RUN_FAILURES and local_count_is_zero(v.scenario, v.world_size, v.mesh):
        consistent, implied = consistent | set(LOCAL_COUNTS), implied | set(LOCAL_COUNTS)
        note = (f"the {v.cause} on {v.scenario}: a rank, microbatch or shard holds no supervised token there, so a "
                "count of its own is zero, and the recipe's way out of that zero (a skipped backward, a raise) left "
                "its peers in a collective")
    sentence = str(diagnosis.get("sentence") or "") or _first_detail(v)
    fix = v.fix or (str(diagnosis["fix"]) if diagnosis.get("fix") else None)
    return Case(row_label(v), v.check, reading, consistent, deviations, sentence, fix, drawn=v.scenario == DRAWN,
                profile=profile, companions=companions, note=note,
                implied=frozenset(implied), coarse=v.precision == "bf16" and reading == "unexplained")


def cases_of(verdicts: Iterable[Verdict]) -> list[Case]:
    """One recipe's failing verdicts as cases: a failed run's checks once (its first), and each linked check's reading
    a companion of the other's in the same case."""
    failing = [v for v in verdicts if v.status == FAIL]
    seen: set[tuple[object, ...]] = set()
    kept = []
    for v in failing:
        if v.cause in RUN_FAILURES:
            if (_key(v), v.cause) in seen:
                continue
            seen.add((_key(v), v.cause))
        kept.append(v)
    by_case: dict[tuple[object, ...], list[Verdict]] = {}
    for v in kept:
        by_case.setdefault(_key(v), []).append(v)
    out = []
    for v in kept:
        linked = [w for w in by_case[_key(v)] if w is not v and any({v.check, w.check} == pair for pair in LINKED)]
        named = [own_reading(w) for w in linked if not own_reading(w).endswith(NUMBERS)]
        out.append(case_of(v, tuple([*named, CLIP] if linked else named)))
    if any(c.reading == OWN_SPLIT for c in out):
        out = [dataclasses.replace(c, consistent=c.consistent | {OWN_SPLIT}, implied=c.implied | {OWN_SPLIT})
               if c.reading in SPLIT_VIEWS else c for c in out]
    return out


def _first_detail(v: Verdict) -> str:
    lines = v.message.strip().splitlines()
    first = lines[0] if lines else ""
    parts = first.split(": ", 2)
    return parts[-1] if len(parts) == 3 else first


def readings(verdicts: Iterable[Verdict]) -> dict[str, RecipeReading]:
    """Each recipe with a failing verdict, and its recipe-level reading (in the verdicts' order)."""
    by: dict[str, list[Verdict]] = {}
    for v in verdicts:
        if v.status == FAIL:
            by.setdefault(v.recipe, []).append(v)
    return {recipe: recipe_reading(cases_of(vs)) for recipe, vs in by.items()}


def names_its_cause(read: RecipeReading, declared: str | None, check: str, shows_as: str = "numbers") -> bool:
    """Whether a negative control's recipe-level reading is its own cause: its ``declared`` signature, one its cases
    cannot tell from it, the linked check's reading of the same cases (a clip's norm beside the parity it moved), or
    the positions' hypothesis that the declared reading's cases share with the others. A control that declares none
    (or ``correct``: its mistake is its target ``check``'s) needs that check to fail and one cause; one whose declared
    reading no case gives (its gradient is right in these cases) is read by its target check's failure; one whose
    declared reading only bf16-lane cases give, where it names nothing, by the one cause the other cases decide."""
    if declared in (None, "correct"):
        return any(c.check == check for c in read.cases) and read.cause is not None
    if not any(c.reading == declared for c in read.cases):
        return read.cause in (f"{check}{NUMBERS}", shows_as)
    if all(c.coarse for c in read.cases if c.reading == declared):  # read in the bf16 lane only, where it names
        return read.cause is not None and any(c.check == check for c in read.cases)  # nothing: the others decide
    linked = {h for c in read.cases if c.reading == declared for h in c.companions}
    unifies = read.cause == POSITION and all(POSITION in c.consistent for c in read.explained())
    return read.cause == declared or declared in read.also or read.cause in linked or unifies


def recipe_json(verdicts: Iterable[Verdict]) -> dict[str, dict[str, object]]:
    """Each failing recipe's reading for the battery report: its cause (None: no one cause), lead, the readings its
    cases cannot tell from the cause, its lines, and every case with its own reading and what it is consistent with."""
    return {recipe: {"cause": read.cause, "lead": read.lead, "also": list(read.also), "lines": read.lines(),
                     "cases": [{"case": c.label, "check": c.check, "reading": c.reading, "drawn": c.drawn,
                                "consistent": sorted(c.consistent), "companions": list(c.companions)}
                               for c in read.cases]}
            for recipe, read in readings(verdicts).items()}


def recipe_lines(verdicts: Sequence[Verdict], titles: Mapping[str, str] | None = None) -> list[str]:
    """Each failing recipe's reading in words (titled by recipe where several ran)."""
    out: list[str] = []
    for recipe, read in readings(verdicts).items():
        out += read.lines((titles or {}).get(recipe))
    return out


__all__ = ["LINKED", "RUN_FAILURES", "case_of", "cases_of", "names_its_cause", "own_reading", "readings", "recipe_json",
           "recipe_lines"]
