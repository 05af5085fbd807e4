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

import math
from collections.abc import Callable, Sequence

from harness.core.fit import Block
from harness.core.signatures import Signature

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
    return None


__all__ = ["ROW_TOLERANCE", "read_rows"]
