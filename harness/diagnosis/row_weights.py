"""What a gradient computes, read off the per-token weight of every row: a mean over which group of tokens.

The per-sequence view of the diagnosis fits one weight per row. Turned into the weight each of the row's tokens got
(the fitted weight times the row's own coefficient under the declared objective: 1 for a token sum, ``1/n_s`` for a
sequence's mean), the weights of a normalization mistake are ``c / (a count of the group the row belongs to)``: the
window (a token mean), a rank (a mean of local means), a microbatch (a mean per microbatch), or the row itself (a
sequence mean), over the group's tokens or its sequences. :func:`read_rows` tries each grouping, the coarsest first,
and names the one that fits, so that a gradient the per-sequence view explains is named by what it computes, under
whichever objective was declared.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from harness.diagnosis.fit import Block
from harness.diagnosis.signatures import Signature

ROW_TOLERANCE = 1e-3
"""Largest relative deviation of the rows' token weights from a grouping's pattern. A row's weight is fitted from
its own gradient alone (one unknown per row: a few hundred against 18,944 components), about ten times less
precisely than a microbatch's; groupings of the battery's windows differ by percents (their counts differ)."""

Key = Callable[[Block], tuple[int, ...]]

GROUPS: tuple[tuple[str, Key, str, str], ...] = (
    ("the window", lambda b: (), "global_scale", ""),
    ("each rank", lambda b: (b.rank,), "mean_of_local_means", "W * "),
    ("each microbatch", lambda b: (b.rank, b.microbatch), "per_microbatch_mean", "W * k * "),
)
"""Groupings a mean may run over: words, key, the signature, and the factors a loop applies beside the group's count
(a rank's mean averaged by DDP over W; a microbatch's divided by k too)."""


def _fit(t: Sequence[float], p: Sequence[float]) -> tuple[float, float]:
    """Best ``c`` with ``t ~ c p`` and the largest deviation relative to ``c p``."""
    c = sum(a * b for a, b in zip(t, p)) / sum(b * b for b in p)
    if c == 0:
        return c, math.inf
    return c, max(abs(a / (c * b) - 1) for a, b in zip(t, p))


def read_rows(rows: Sequence[Block], token_weight: Sequence[float], world_size: int, k: int, residual: float,
              declared: str) -> Signature | None:
    """The grouping whose mean the rows' token weights ``token_weight`` (one per row, absolute) are, with its factor
    against a right loop's (``1/(W * k * count)`` for a microbatch's mean); None when none fits, when it is the
    window's sequence mean (the declared objective's own reading), or when rows of equal length cannot tell a
    sequence mean from a token mean. ``residual``: the per-sequence fit's, quoted; ``declared``: what the declared
    objective gives, in words."""
    live = [(b, t) for b, t in zip(rows, token_weight) if b.tokens > 0 and math.isfinite(t)]
    if len(live) < 2 or len({b.tokens for b, _ in live}) < 2:
        return None
    weights = [t for _, t in live]
    for what, key, name, factors in GROUPS:
        tokens: dict[tuple[int, ...], int] = {}
        seqs: dict[tuple[int, ...], int] = {}
        for b, _ in live:
            tokens[key(b)] = tokens.get(key(b), 0) + b.tokens
            seqs[key(b)] = seqs.get(key(b), 0) + 1
        for kind, pattern, count in (
                ("token", [1 / tokens[key(b)] for b, _ in live], "its token count"),
                ("sequence", [1 / (b.tokens * seqs[key(b)]) for b, _ in live],
                 "its sequence count * the row's length")):
            c, dev = _fit(weights, pattern)
            if dev > ROW_TOLERANCE:
                continue
            if what == "the window" and kind == "sequence":
                return None  # the declared sequence mean, right or scaled: the microbatch fit reads that
            scale = c * (world_size if factors else 1) * (k if factors == "W * k * " else 1)
            times = "" if abs(scale - 1) <= ROW_TOLERANCE else f", times {scale:.4g}"
            return Signature(name, f"a {kind} mean over {what}: every token weighs 1/({factors}{count}){times}; the "
                             f"per-sequence view fits it (residual {residual:.1e}), where {declared}", scale)
    every = {r: sum(1 for b in rows if b.rank == r) for r in {b.rank for b in rows}}
    return read_own_splits(live, world_size, residual, declared, every)


@dataclasses.dataclass(frozen=True)
class _Split:
    """One rank's rows grouped by equal token weight (a group is a micro-batch, or several of one weight)."""

    unit: float
    """The lightest group's weight (its weight x tokens)."""
    count: int | None
    """``K``: the groups' weights in units summed, where each is a whole multiple of :attr:`unit` (None: not)."""
    largest: int
    """Rows in the largest group."""
    per_row: float | None
    """Each row's share of its group's weight, where every group weighs in proportion to its rows (each micro-batch
    weighing its rows' share); None otherwise."""
    rows_differ: bool
    """Whether the groups hold different numbers of rows (only then does :attr:`per_row` tell a weight by rows from
    one by micro-batches)."""
    masses: tuple[float, ...] = ()
    """Each group's weight x tokens."""
    group_rows: tuple[int, ...] = ()
    """Each group's rows (those with a supervised token)."""


def _own_split(held: Sequence[tuple[Block, float]]) -> _Split | None:
    """:class:`_Split` of one rank's rows (None: a group without weight)."""
    groups: list[list[float]] = []  # [token weight, tokens, rows]
    for b, t in sorted(held, key=lambda bt: bt[1]):
        if groups and abs(t / groups[-1][0] - 1) <= ROW_TOLERANCE:
            groups[-1][1] += b.tokens
            groups[-1][2] += 1
        else:
            groups.append([t, b.tokens, 1])
    masses = [w * n for w, n, _ in groups]
    unit = min(masses)
    if unit <= 0:
        return None
    multiples = [round(m / unit) for m in masses]
    whole = all(abs(m / (j * unit) - 1) <= ROW_TOLERANCE for m, j in zip(masses, multiples))
    shares = [m / rows for m, (_, _, rows) in zip(masses, groups)]
    even = max(abs(x / shares[0] - 1) for x in shares) <= ROW_TOLERANCE
    return _Split(unit, sum(multiples) if whole else None, int(max(rows for _, _, rows in groups)),
                  shares[0] if even else None, len({rows for _, _, rows in groups}) > 1, tuple(masses),
                  tuple(int(rows) for _, _, rows in groups))


def read_own_splits(live: Sequence[tuple[Block, float]], world_size: int, residual: float,
                    declared: str, every: dict[int, int] | None = None) -> Signature | None:
    """``dynamic_microbatch_mean`` where the rows' token weights are each rank's own micro-batches' token means,
    each divided by that rank's micro-batch count ``K_r``: rows of one micro-batch share the weight
    ``1/(W * K_r * n_d)`` (``n_d`` its supervised tokens), so each micro-batch weighs ``1/(W * K_r)`` whatever its
    tokens. The micro-batches are the rank's own re-split of its rows (a token budget, verl's ``use_dynamic_bsz``),
    not the window's microbatches, and are read off the weights: groups of equal token weight. ``K_r`` is the
    groups' count (a group of two micro-batches of one count weighs twice); where a rank's split also held
    micro-batches without a supervised token, they count in ``K_r`` unseen, and the weights read at scale 1 give it.
    Where every rank's groups weigh in proportion to their rows, and some rank's groups hold different numbers of
    rows, each micro-batch's mean was weighted by its share of the rank's rows instead:
    ``dynamic_microbatch_rows_share`` (where every micro-batch holds as many rows the two are one gradient, and the
    first reading stays).
    None where a rank's groups do not weigh whole multiples of one weight, where no group holds two rows (a mean per
    row is a sequence mean), or where ranks' scales differ."""
    by_rank: dict[int, list[tuple[Block, float]]] = {}
    for b, t in live:
        by_rank.setdefault(b.rank, []).append((b, t))
    splits = {r: _own_split(held) for r, held in sorted(by_rank.items())}
    if any(s is None for s in splits.values()) or max(s.largest for s in splits.values() if s) < 2:
        return None
    held = {r: s for r, s in splits.items() if s is not None}
    shares = {r: s.per_row for r, s in held.items() if s.per_row is not None}
    if len(shares) == len(held) and any(s.rows_differ for s in held.values()):
        rows = {r: len(by_rank[r]) for r in held}
        scale = sum(world_size * rows[r] * share for r, share in shares.items()) / len(shares)
        spread = max(abs(world_size * rows[r] * share / scale - 1) for r, share in shares.items())
        if spread <= ROW_TOLERANCE:
            return _rows_share(rows, scale, residual, declared)
    counts = {r: s.count for r, s in held.items() if s.count is not None}
    if len(counts) < len(held) or all(k == 1 for k in counts.values()):
        # Not whole multiples (or one micro-batch per rank, a mean of local means): rows without a supervised token
        # may sit in the micro-batches, counted in their rows' share though the weights cannot show them.
        return _rows_share_with_unseen(held, every or {}, world_size, residual, declared)
    scales = [world_size * counts[r] * s.unit for r, s in held.items()]
    c = sum(scales) / len(scales)
    if max(abs(x / c - 1) for x in scales) > ROW_TOLERANCE:
        whole = {r: 1 / (world_size * s.unit) for r, s in held.items()}  # scale 1: K_r is 1/(W u)
        if any(abs(x - round(x)) > ROW_TOLERANCE * x or round(x) < counts[r] for r, x in whole.items()):
            return None
        c, counts = 1.0, {r: round(x) for r, x in whole.items()}
    times = "" if abs(c - 1) <= ROW_TOLERANCE else f", times {c:.4g}"
    said = ", ".join(f"rank {r}: {k}" for r, k in counts.items())
    return Signature("dynamic_microbatch_mean", f"a token mean per micro-batch of each rank's own split, divided by "
                     f"the rank's micro-batch count K_r ({said}): every token of micro-batch d weighs "
                     f"1/(W * K_r * n_d){times}, so each micro-batch weighs 1/(W * K_r) whatever its tokens (a window "
                     f"re-split by a token budget, each micro-batch's mean over the rank's count); the per-sequence "
                     f"view fits it (residual {residual:.1e}), where {declared}", c,
                     alternatives=("dynamic_microbatch_rows_share",) if len(shares) == len(held) else ())


def _rows_share_with_unseen(held: dict[int, _Split], every: dict[int, int], world_size: int, residual: float,
                            declared: str) -> Signature | None:
    """``dynamic_microbatch_rows_share`` at scale 1 where micro-batches also hold rows without a supervised token:
    each group's weight is then a whole number of rows' shares ``1/(W * B_r)`` (``B_r`` every row of the rank, those
    without a token included), at least its rows with a token, at most ``B_r`` over the groups; and some rank's
    groups weigh unlike numbers of shares (else a mean per micro-batch reads the same). None where that fails."""
    if not held or any(r not in every for r in held):
        return None
    differ = False
    for r, split in held.items():
        share = 1 / (world_size * every[r])
        units = [m / share for m in split.masses]
        whole = [round(u) for u in units]
        if any(abs(u - j) > ROW_TOLERANCE * max(j, 1) or j < n for u, j, n in zip(units, whole, split.group_rows)):
            return None
        if sum(whole) > every[r]:
            return None
        differ = differ or len(set(whole)) > 1
    return _rows_share(dict(every), 1.0, residual, declared) if differ else None


def _rows_share(rows: dict[int, int], scale: float, residual: float, declared: str) -> Signature:
    times = "" if abs(scale - 1) <= ROW_TOLERANCE else f", times {scale:.4g}"
    said = ", ".join(f"rank {r}: B_r={b}" for r, b in rows.items())
    return Signature("dynamic_microbatch_rows_share", f"a token mean per micro-batch of each rank's own split, "
                     f"weighted by the micro-batch's share of the rank's rows ({said}): every token of micro-batch d "
                     f"weighs B_d/(W * B_r * n_d){times}, so a micro-batch of B_d rows weighs B_d/(W * B_r) whatever "
                     f"its tokens (a window re-split by a token budget, each micro-batch's mean times its rows over "
                     f"the rank's: verl's FSDP actor under use_dynamic_bsz); the per-sequence view fits it (residual "
                     f"{residual:.1e}), where {declared}", scale)


def merge_chunks(rows: Sequence[Block], token_weight: Sequence[float], whole: Sequence[int], cp: int
                 ) -> tuple[list[Block], list[float]] | None:
    """Under cp: the rows of each data rank, each chunk of a row merged into the whole row (``rank`` its data rank,
    ``tokens`` its count over the chunks, ``whole``), where every chunk of a row gives its tokens one weight: a count
    local to a data rank (its sequences, every cp rank of a data coordinate holding its rows) weighs the chunks of a
    row alike. ``rows``' ranks are token ranks (data rank x cp + cp rank). None where the chunks of a row weigh
    apart (a count local to a token rank, or a mean per chunk)."""
    merged: dict[tuple[int, int, int | None], tuple[Block, list[float]]] = {}
    for b, t, n in zip(rows, token_weight, whole):
        if b.tokens > 0 and math.isfinite(t):
            key = (b.rank // cp, b.microbatch, b.row)
            held = merged.setdefault(key, (dataclasses.replace(b, rank=key[0], tokens=n, holder=None), []))
            held[1].append(t)
    out_rows, out_weights = [], []
    for b, ts in merged.values():
        mean = sum(ts) / len(ts)
        if mean == 0 or max(abs(t / mean - 1) for t in ts) > ROW_TOLERANCE:
            return None
        out_rows.append(b)
        out_weights.append(mean)
    return out_rows, out_weights


def pack_mean_weights(rows: Sequence[Block], packs: Sequence[int]) -> list[float]:
    """Each row's token weight under a mean over packed rows: ``1/(n_r * P)`` for a row in pack ``r`` (``packs``: each
    row's pack, numbered over the window; ``n_r`` the pack's supervised tokens, ``P`` the packs that hold one); nan for
    a row without a supervised token."""
    tokens: dict[int, int] = {}
    for b, p in zip(rows, packs):
        if b.tokens > 0:
            tokens[p] = tokens.get(p, 0) + b.tokens
    return [1 / (tokens[p] * len(tokens)) if b.tokens > 0 else math.nan for b, p in zip(rows, packs)]


def read_packs(rows: Sequence[Block], token_weight: Sequence[float], packs: Sequence[int], residual: float,
               declared: str) -> Signature | None:
    """``per_pack_mean`` when the rows' token weights are a mean over packed rows (:func:`pack_mean_weights`, up to
    a scale): a sequence mean that counted a packed batch's rows, several sequences each, as its sequences. None where
    no pack holds two supervised sequences (each pack is then one sequence: the sequence mean itself), or where the
    weights do not fit."""
    live = [i for i, b in enumerate(rows) if b.tokens > 0 and math.isfinite(token_weight[i])]
    held: dict[int, int] = {}
    for i in live:
        held[packs[i]] = held.get(packs[i], 0) + 1
    if len(live) < 2 or max(held.values()) < 2:
        return None
    pattern = pack_mean_weights([rows[i] for i in live], [packs[i] for i in live])
    c, dev = _fit([token_weight[i] for i in live], pattern)
    if dev > ROW_TOLERANCE:
        return None
    times = "" if abs(c - 1) <= ROW_TOLERANCE else f", times {c:.4g}"
    return Signature("per_pack_mean", f"a mean over packed rows, not sequences: every token of pack r weighs "
                     f"1/(n_r * P), n_r the pack's supervised tokens and P={len(held)} the packs{times} (a row's mean "
                     f"taken for its sequence's: count the sequences by seq_idx or position_ids' restarts, never the "
                     f"rows); the per-sequence view fits it (residual {residual:.1e}), where {declared}", c)


__all__ = ["ROW_TOLERANCE", "merge_chunks", "pack_mean_weights", "read_own_splits", "read_packs", "read_rows"]
