"""The catalog of signatures and the classification of fitted weights: which mistake a gradient's weights name.

:func:`classify` reads the weights of a microbatch-level fit (:func:`harness.diagnosis.fit.fit_weights`), as ratios
``q = w * N`` to the right ones, against a catalog of signatures (:data:`SIGNATURES`) whose expected weights come from
the window's own counts (:func:`patterns`), never from constants; a common scale on every weight is named from the
same counts (:mod:`harness.diagnosis.factor_names`). :func:`classify_sequences` reads a fit of one weight per row.
``tests/unit/test_diagnosis.py`` names each catalog signature from real counts; ``tests/distributed/test_diagnosis.py``
diagnoses every negative control.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from harness.diagnosis import window_facts as wf
from harness.diagnosis.factor_names import MAX_CONSTANT, close, factor_readings, microbatches_per_rank, name_factor
from harness.diagnosis.fit import (
    EXACT_TOLERANCE,
    FLOAT32_RESIDUAL,
    FLOAT64_RESIDUAL,
    MAX_CONDITION,
    Block,
    Fit,
    exact_tolerance,
    explained_residual,
    match_tolerance,
    rounding_residual,
)
from harness.diagnosis.signature_catalog import SIGNATURES


@dataclass(frozen=True)
class Signature:
    name: str
    sentence: str
    factor: float | None = None
    """The common scale ``c`` of the matched pattern (1 when the pattern holds exactly)."""
    blocks: tuple[str, ...] = ()
    """The blocks a dropped/double-counted signature names."""
    alternatives: tuple[str, ...] = ()
    """Other signatures these counts cannot tell apart from this one."""
    objective: str | None = None
    """The declared objective (:data:`harness.core.objectives.OBJECTIVES`) this gradient computes, where it is
    another than the run's own."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _rank_counts(blocks: Sequence[Block]) -> dict[int, int]:
    out: dict[int, int] = {}
    for b in blocks:
        out[b.rank] = out.get(b.rank, 0) + b.tokens
    return out


def patterns(blocks: Sequence[Block], world_size: int) -> dict[str, list[float]]:
    """Each re-weighting signature's expected ratio per block, from the blocks' real counts."""
    n = sum(b.tokens for b in blocks)
    per_rank, k = _rank_counts(blocks), microbatches_per_rank(blocks)
    per_mb: dict[tuple[int, int], int] = {}
    for b in blocks:
        per_mb[(b.rank, b.microbatch)] = per_mb.get((b.rank, b.microbatch), 0) + b.tokens

    def ratio(denominator: float) -> float:
        return n / denominator if denominator > 0 else math.nan

    found = {
        "correct": [1.0 for _ in blocks],
        "mean_of_local_means": [ratio(world_size * per_rank[b.rank]) for b in blocks],
        "per_microbatch_mean": [ratio(world_size * k[b.rank] * per_mb[(b.rank, b.microbatch)]) for b in blocks],
    }
    # Each microbatch's mean over its supervised tokens weighted by its real tokens (prompt and all) over the
    # window's (composer #3677): only where the blocks' real tokens are known and their ratios to the supervised
    # counts differ (else it is the token mean).
    live = [b for b in blocks if b.tokens]
    real = sum(b.real for b in blocks)
    if live and real and all(b.real for b in live) and len({round(b.real / b.tokens, 9) for b in live}) > 1:
        found["weighted_by_real_tokens"] = [n * b.real / (b.tokens * real) if b.tokens else math.nan for b in blocks]
    return found


def scale_fit(q: Sequence[float], p: Sequence[float]) -> tuple[float, float]:
    """Best ``c`` with ``q ~ c p`` and the largest deviation relative to ``max |c p|``."""
    pairs = [(a, b) for a, b in zip(q, p) if math.isfinite(a) and math.isfinite(b)]
    if not pairs:
        return math.nan, math.inf
    c = sum(a * b for a, b in pairs) / sum(b * b for _, b in pairs)
    top = max(abs(c * b) for _, b in pairs)
    if top == 0:
        return c, math.inf
    return c, max(abs(a - c * b) for a, b in pairs) / top


def _window_counts(blocks: Sequence[Block], world_size: int,
                   other_counts: Mapping[str, int] | None) -> list[tuple[float, str]]:
    """The token counts of this window a recipe may have divided by instead of ``N``
    (:func:`harness.diagnosis.window_facts.window_facts`)."""
    return [(f.value, f.words) for f in wf.window_facts(blocks, world_size, other_counts) if f.cost == 1]


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _block_groups(blocks: Sequence[Block], q: Sequence[float]) -> tuple[float, dict[int, list[int]]] | None:
    """Blocks whose ratios are each 0, 1 or 2 times one common value ``c``: ``(c, {multiple: [block index]})``,
    with ``c`` the value that most blocks share (None when no such ``c`` exists)."""
    live = [(i, v) for i, v in enumerate(q) if math.isfinite(v) and blocks[i].tokens > 0]
    if not live:
        return None
    top = max(abs(v) for _, v in live)
    best: tuple[int, float, dict[int, list[int]]] | None = None
    for _, c in live:
        if abs(c) <= match_tolerance() * top:
            continue
        groups: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for i, v in live:
            m = round(v / c)
            if m not in groups or abs(v - m * c) > match_tolerance() * abs(c) * max(m, 1):
                break
            groups[m].append(i)
        else:
            if best is None or len(groups[1]) > best[0]:
                best = (len(groups[1]), c, groups)
    return None if best is None else (best[1], best[2])


def classify(blocks: Sequence[Block], fit: Fit, world_size: int, precision: str, rank: int | None = None,
             other_counts: Mapping[str, int] | None = None, layout: wf.Layout | None = None) -> Signature:
    """The catalog signature that the fitted weights of a microbatch-level fit match.

    ``blocks`` must hold every microbatch of every rank (empty ones with ``tokens=0``) so that microbatch counts
    ``k`` are the window's; ``rank`` is the rank whose gradient was fitted (to recognize a gradient that holds only
    that rank's own blocks); ``other_counts`` and ``layout`` (the run's mesh and pipeline facts) as in
    :func:`harness.diagnosis.factor_names.name_factor`.
    """
    n = sum(b.tokens for b in blocks)
    q = [float(w) * n for w in fit.weights]
    if not fit.condition <= MAX_CONDITION:
        return Signature("unexplained", f"the blocks' gradients are too alike to weigh them apart (condition number "
                         f"{fit.condition:.3g}; more blocks than gradient components, or microbatches that give the "
                         "same gradient): read the per-parameter table")
    if fit.residual > explained_residual():
        return Signature("unexplained", f"not a re-weighting of the microbatches' losses (the best weights leave "
                         f"{fit.residual:.2e} of the gradient unexplained)")
    exact = exact_tolerance(precision)
    unsynced = _own_blocks_only(blocks, q, world_size, rank)
    if unsynced is not None:
        return unsynced
    found: list[tuple[float, str, float]] = []
    for name, p in patterns(blocks, world_size).items():
        c, dev = scale_fit(q, p)
        if dev <= match_tolerance():
            found.append((dev, name, c))
    if found:
        # A pattern that holds as it is explains the weights with one mistake; the same weights read as another
        # pattern times a factor would need two. A pattern these counts cannot tell from a common scale (one rank
        # holds every token, microbatches of equal counts) is not evidenced: the scale is read first.
        plain = any(other == "correct" for _, other, _ in found)
        found.sort(key=lambda t: (not (plain and t[1] == "correct"), abs(t[2] - 1) > match_tolerance(), t[0]))
        dev, name, c = found[0]
        others = tuple(dict.fromkeys(
            ("global_scale" if other == "correct" and abs(oc - 1) > match_tolerance() else other)
            for _, other, oc in found[1:]))
        worst = max(abs(v - 1) for v in _finite(q))
        if name == "correct":
            rounding = rounding_residual(precision)
            if worst <= exact and fit.residual <= rounding:
                return Signature("correct", f"the weighting is right: every token weighs 1/N (N={n}) to within "
                                 f"{worst:.1e}, residual {fit.residual:.1e} (under the {precision} rounding bound "
                                 f"{rounding:g})", 1.0)
            if worst <= EXACT_TOLERANCE["fp32"] and precision == "fp64" and fit.residual <= FLOAT32_RESIDUAL:
                return Signature("float32_computation", f"the weighting is right (every weight 1/N to {worst:.1e}); "
                                 f"the residual {fit.residual:.1e} is float32 rounding (between the float64 bound "
                                 f"{FLOAT64_RESIDUAL:g} and the float32 bound {FLOAT32_RESIDUAL:g}): part of the loss "
                                 "or gradient was computed in float32", 1.0)
            if worst <= EXACT_TOLERANCE["fp32"] and fit.residual > rounding:
                return Signature("extra_term", extra_term_sentence(fit.residual, precision, worst), 1.0)
            tol = scale_tolerance(q, c, fit, precision)
            readings = factor_readings(c, blocks, world_size, other_counts, tol)
            named = name_factor(c, blocks, world_size, other_counts, tol, layout)
            constant = bool(readings) and "fixed accumulation constant" in readings[0]
            return Signature("fixed_accumulation_constant" if constant else "global_scale", named, c,
                             alternatives=others)
        if name == "per_microbatch_mean":
            constant_k = _fixed_constant(c, blocks)
            if constant_k is not None:
                k, big_k = constant_k
                return Signature("fixed_accumulation_constant", "each microbatch's tokens weigh 1/(W * K * its own "
                                 f"count): each microbatch's mean divided by a fixed accumulation constant K={big_k} "
                                 f"where the window has k={k} microbatches", c, alternatives=others)
        named = name_factor(c, blocks, world_size, other_counts, layout=layout)
        scale = "" if abs(c - 1) <= match_tolerance() else f", and then {named}"
        return Signature(name, _describe(name, blocks, q, world_size) + scale, c, alternatives=others)
    subgroup = _subgroup_count(blocks, q, world_size, other_counts)
    if subgroup is not None:
        return subgroup
    groups = _block_groups(blocks, q)
    if groups is not None:
        c, by = groups
        dropped = tuple(blocks[i].label() for i in by[0])
        doubled = tuple(blocks[i].label() for i in by[2])
        parts = []
        if dropped:
            parts.append(f"{_join(dropped)} contributed nothing")
        if doubled:
            parts.append(f"{_join(doubled)} counted twice")
        if abs(c - 1) > match_tolerance():
            parts.append(f"the others: {name_factor(c, blocks, world_size, other_counts, layout=layout)}")
        name = "dropped" if dropped else "double_counted"
        return Signature(name, "; ".join(parts), c, blocks=dropped or doubled)
    scaled = _blocks_scaled(blocks, q, world_size, other_counts)
    if scaled is not None:
        return scaled
    return Signature("unexplained", "a re-weighting outside the catalog (the residual is small): read the weight "
                     "table")


def scale_tolerance(q: Sequence[float], c: float, fit: Fit, precision: str) -> float:
    """How closely a common scale ``c`` read off the ratios ``q`` is known, and so how close a fact of the window
    must come to name it: four times the ratios' own spread around ``c`` or the fit's residual, at least a tenth of
    the precision's exactness bound (one block alone has no spread), at most
    :func:`harness.diagnosis.fit.match_tolerance`."""
    live = _finite(q)
    spread = max((abs(v - c) for v in live), default=0.0) / abs(c) if live and c else math.inf
    return min(match_tolerance(), max(exact_tolerance(precision) / 10, 4 * spread, 4 * fit.residual))


def extra_term_sentence(residual: float, precision: str, worst: float | None = None) -> str:
    """The words for right weights that leave ``residual`` unexplained, with the rounding bound it exceeds."""
    bound = rounding_residual(precision)
    weights = "the weights are right" + ("" if worst is None else f" (every weight 1/N to {worst:.1e})")
    return (f"{weights}, and {residual:.2e} of the gradient is no re-weighting of the losses (above the {precision} "
            f"rounding bound {bound:g}): an extra term (an auxiliary loss, a regularizer, a custom backward adding "
            "into .grad)")


def _fixed_constant(c: float, blocks: Sequence[Block]) -> tuple[int, int] | None:
    """``(k, K)`` when a per-microbatch mean's scale ``c`` is ``k/K`` for an integer ``K != k`` (each microbatch's
    mean divided by a constant ``K`` instead of the window's ``k``)."""
    ks = set(microbatches_per_rank(blocks).values())
    if len(ks) != 1 or not math.isfinite(c) or c <= 0:
        return None
    (k,) = ks
    value = k / c
    big_k = round(value)
    if 2 <= big_k <= MAX_CONSTANT and big_k != k and close(value, big_k):
        return k, big_k
    return None


def _blocks_scaled(blocks: Sequence[Block], q: Sequence[float], world_size: int,
                   other_counts: Mapping[str, int] | None) -> Signature | None:
    """``block_scaled``: every block right (ratio 1) but those of one microbatch index or one rank, each off by a
    factor (named as a count of the window where one matches)."""
    live = [(b, v) for b, v in zip(blocks, q) if b.tokens > 0 and math.isfinite(v)]
    off = [(b, v) for b, v in live if abs(v - 1) > match_tolerance()]
    if not off or len(off) == len(live) or any(v <= 0 for _, v in off):
        return None
    same_index = len({b.microbatch for b, _ in off}) == 1 and len({b.rank for b, _ in live}) > 1
    same_rank = len({b.rank for b, _ in off}) == 1 and len({b.microbatch for b, _ in live}) > 1
    if not (same_index or (same_rank and len(off) > 1) or len(off) == 1):
        return None
    n = sum(b.tokens for b in blocks)
    counts = _window_counts(blocks, world_size, other_counts)
    parts = []
    for b, v in off:
        words = [w for x, w in counts if close(v, n / x)]
        named = f" (normalized by {words[0]} where the window holds N={n})" if words else ""
        parts.append(f"{b.label()} weighs {v:.4g}x the right weight{named}")
    return Signature("block_scaled", f"{'; '.join(parts)}, every other block right: a count taken for that "
                     "microbatch alone (a stale or local count)", blocks=tuple(b.label() for b, _ in off))


def _subgroup_count(blocks: Sequence[Block], q: Sequence[float], world_size: int,
                    other_counts: Mapping[str, int] | None) -> Signature | None:
    """``subgroup_count``: every block of a group of ``size`` consecutive ranks (``size`` a divisor of W between 1
    and W: the ranks of one node) weighs ``N / N_g``, ``N_g`` the group's count, up to a common scale: the count was
    all-reduced over the group, not over every rank. Groups of equal counts read as a common scale instead."""
    n = sum(b.tokens for b in blocks)
    per_rank = _rank_counts(blocks)
    for size in range(2, world_size):
        if world_size % size:
            continue
        group = {r: sum(per_rank.get(s, 0) for s in range(r // size * size, (r // size + 1) * size))
                 for r in per_rank}
        if len({c for c in group.values() if c > 0}) < 2:
            continue
        c, dev = scale_fit(q, [n / group[b.rank] if group[b.rank] > 0 else math.nan for b in blocks])
        if dev > match_tolerance():
            continue
        parts = []
        for first in range(0, world_size, size)[:4]:
            ng = group.get(first, 0)
            if ng > 0:
                parts.append(f"ranks {first}-{first + size - 1}'s tokens ({ng} of N={n}) weigh {c * n / ng:.3g}x "
                             "the right weight")
        more = "; and more groups" if world_size // size > 4 else ""
        named = name_factor(c, blocks, world_size, other_counts)
        scale = "" if abs(c - 1) <= match_tolerance() else f", and then {named}"
        return Signature("subgroup_count", f"each group of {size} consecutive ranks' tokens weigh 1/(its group's "
                         f"count): the count was all-reduced over a sub-group of {size} ranks (the ranks of one node, "
                         f"LOCAL_WORLD_SIZE={size}), not over every data-parallel rank; {'; '.join(parts)}{more}"
                         f"{scale}", c)
    return None


def _own_blocks_only(blocks: Sequence[Block], q: Sequence[float], world_size: int,
                     rank: int | None) -> Signature | None:
    """``not_synchronized`` when the fitted rank's gradient holds its own blocks and nothing of any other rank's,
    whatever its own blocks weigh (named: W times the right weight is a correct local step never synchronized)."""
    if world_size < 2 or rank is None:
        return None
    live = [(b, v) for b, v in zip(blocks, q) if b.tokens > 0 and math.isfinite(v)]
    own = [v for b, v in live if b.rank == rank]
    others = [v for b, v in live if b.rank != rank]
    top = max((abs(v) for _, v in live), default=0.0)
    if not own or not others or top == 0:
        return None
    if any(abs(v) > match_tolerance() * top for v in others) or any(abs(v) <= match_tolerance() * top for v in own):
        return None
    head = (f"rank {rank}'s gradient holds only its own microbatches: the gradients were never synchronized (the last "
            "backward ran inside no_sync(), or the synchronization was keyed to something other than the window's end)")
    if all(abs(v - world_size) <= match_tolerance() * world_size for v in own):
        words = f"; its own tokens weigh W={world_size} times the right weight, as a synchronized step would have given"
    else:
        words = f"; its own microbatches weigh {_join([f'{v:.3g}x' for v in own])} the right weight"
    return Signature("not_synchronized", head + words, sum(own) / len(own),
                     blocks=tuple(b.label() for b, _ in live if b.rank != rank))


def classify_sequences(blocks: Sequence[Block], fit: Fit) -> Signature | None:
    """The per-sequence reading of a sequence-level fit (one block per row): a mean per sequence when every row's
    weight times its token count is one value per rank."""
    if fit.residual > explained_residual():
        return None
    by_rank: dict[int, list[float]] = {}
    for b, w in zip(blocks, fit.weights):
        if b.tokens > 0 and math.isfinite(float(w)):
            by_rank.setdefault(b.rank, []).append(float(w) * b.tokens)
    if not by_rank:
        return None
    for values in by_rank.values():
        top = max(abs(v) for v in values)
        if top == 0 or max(values) - min(values) > match_tolerance() * top:
            return None
    live = [(b, float(w)) for b, w in zip(blocks, fit.weights) if b.tokens > 0 and math.isfinite(float(w))]
    if len({b.tokens for b, _ in live}) == 1:
        return None  # equal lengths: per-sequence and per-token weights coincide
    hi, lo = max(live, key=lambda t: t[1]), min(live, key=lambda t: t[1])
    return Signature("per_sequence_mean", "each sequence weighs the same whatever its length: a mean per sequence "
                     f"({hi[0].label()}, {hi[0].tokens} tokens, weighs each token {hi[1] / lo[1]:.2g}x "
                     f"{lo[0].label()}, {lo[0].tokens} tokens)")


def _join(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _describe(name: str, blocks: Sequence[Block], q: Sequence[float], world_size: int) -> str:
    per_rank: dict[int, list[float]] = {}
    for b, v in zip(blocks, q):
        if math.isfinite(v):
            per_rank.setdefault(b.rank, []).append(v)
    if name == "weighted_by_real_tokens":
        held = [b for b in blocks if b.tokens]
        top = max(held, key=lambda b: b.real / b.tokens)
        low = min(held, key=lambda b: b.real / b.tokens)
        return ("each microbatch's tokens weigh (its real tokens / its supervised tokens) / R: each microbatch's mean "
                "over its supervised tokens, weighted by its real (non-padding) tokens over the window's R, prompt "
                f"tokens and each row's last position included; {top.label()} ({top.real} real, {top.tokens} "
                f"supervised) weighs each token {(top.real / top.tokens) / (low.real / low.tokens):.3g}x "
                f"{low.label()} ({low.real} real, {low.tokens} supervised)")
    if name == "mean_of_local_means":
        means = {r: sum(v) / len(v) for r, v in per_rank.items()}
        hi, lo = max(means, key=means.__getitem__), min(means, key=means.__getitem__)
        head = ("each rank's tokens weigh 1/(W * its own count): each rank divided by its own count: a mean of "
                "local means")
        if hi == lo:
            return f"{head}; only rank {hi} holds tokens here, so its tokens weigh {means[hi]:.3g}x the right weight"
        return f"{head}; rank {hi}'s tokens weigh {means[hi] / means[lo]:.2g}x rank {lo}'s"
    live = [(b, v) for b, v in zip(blocks, q) if math.isfinite(v)]
    hi_b, hi_v = max(live, key=lambda t: t[1])
    lo_b, lo_v = min(live, key=lambda t: t[1])
    head = "each microbatch's tokens weigh 1/(k * W * its own count): a mean per microbatch"
    if hi_b == lo_b:
        return f"{head}; only {hi_b.label()} holds tokens here"
    return f"{head}; {hi_b.label()}'s tokens weigh {hi_v / lo_v:.2g}x {lo_b.label()}'s"


__all__ = [
    "SIGNATURES",
    "Signature",
    "classify",
    "classify_sequences",
    "extra_term_sentence",
    "patterns",
    "scale_fit",
    "scale_tolerance",
]
