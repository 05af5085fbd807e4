"""What a common scale on every fitted weight means, in words, from the window's counts.

The catalog's factors come first, the commoner in real code first: the world-size factor missing or applied twice,
the microbatch count, a factor 2, their powers and products, a fixed accumulation constant ``K`` in place of the
window's ``k``. Where none matches, every expression in the window's facts (:mod:`harness.diagnosis.window_facts`) is
searched. :func:`name_factor` is the sentence a signature carries; :func:`factor_readings` every reading the counts
cannot tell apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from harness.diagnosis import window_facts as wf
from harness.diagnosis.fit import Block, match_tolerance


def microbatches_per_rank(blocks: Sequence[Block]) -> dict[int, int]:
    """Each rank's microbatch count ``k``."""
    out: dict[int, set[int]] = {}
    for b in blocks:
        out.setdefault(b.rank, set()).add(b.microbatch)
    return {r: len(m) for r, m in out.items()}


MAX_CONSTANT = 64
"""Largest fixed accumulation constant ``K`` named (``every weight 1/K``, ``k/K``)."""


def close(c: float, value: float, tolerance: float | None = None) -> bool:
    """``c`` within ``tolerance`` of ``value``, relatively (default :func:`harness.diagnosis.fit.match_tolerance`)."""
    return value != 0 and abs(c / value - 1) <= (match_tolerance() if tolerance is None else tolerance)


def factor_readings(c: float, blocks: Sequence[Block], world_size: int,
                    other_counts: Mapping[str, int] | None = None, tolerance: float | None = None,
                    layout: wf.Layout | None = None) -> list[str]:
    """Every named cause of a common scale ``c`` on every weight, the commoner in real code first (empty: none):
    the catalog's factors, then every expression in the window's facts (:func:`harness.diagnosis.window_facts.search`)
    within ``tolerance`` (default :func:`harness.diagnosis.fit.match_tolerance`;
    :func:`harness.diagnosis.signatures.scale_tolerance` derives it from a fit). With the run's ``layout``
    (:class:`harness.diagnosis.axes.Axes`) its sizes are facts too, and a catalog factor that one of them equals here
    (k and cp both 2) names both and the window that tells them apart."""
    tol = match_tolerance() if tolerance is None else tolerance
    ks = set(microbatches_per_rank(blocks).values())
    n = sum(b.tokens for b in blocks)
    w = world_size
    named: list[tuple[float, str]] = []
    if w > 1:
        named += [
            (1 / w, f"the world-size factor is missing (every weight is 1/W of what it should be, W={w})"),
            (float(w), f"the world-size factor is applied twice (every weight is W={w} times too large: a summing "
                       "reduction, or a loss already multiplied by W)"),
        ]
    k = next(iter(ks)) if len(ks) == 1 else None
    if k is not None and k > 1:
        named += [
            (1 / k, f"an extra division by the microbatch count k={k}"),
            (float(k), f"the division by the microbatch count k={k} is missing (every weight is k times too large)"),
        ]
    named.append((2.0, "every weight is twice the right one (each microbatch backpropagated twice)"))
    if w > 1:
        named += [
            (1 / w**2, f"the loss divided by W twice (every weight is 1/W^2 of what it should be, W={w})"),
            (float(w**2), f"the loss multiplied by W twice (every weight is W^2={w**2} times too large)"),
        ]
        if k is not None and k > 1:
            named.append((1 / (k * w), f"an extra division by the microbatch count k={k} and the world-size factor "
                                       f"missing (W={w})"))
    if w != 2:
        named.append((2 / w, f"a world-size factor written for W=2 (every weight is 2/W, here W={w})"))
        named.append((w / 2, f"a count averaged over the ranks (divided by W) and multiplied by a factor 2 written for "
                             f"W=2 (every weight is W/2, here W={w})"))
    # A constant K in place of k: the right loss divided by K (1/c = K), or, where every microbatch holds the same
    # count (a mean per microbatch is then a common scale), each microbatch's mean divided by K (k/c = K).
    equal = len({b.tokens for b in blocks if b.tokens}) == 1
    constants = {v for v in (1 / c, (k or 0) / c if equal else 0.0) if math.isfinite(v)}
    for value in sorted(constants):
        big_k = round(value)
        if (2 <= big_k <= MAX_CONSTANT and big_k != k and big_k not in (w, w * w, w * (k or 1))
                and close(value, big_k, tol)):
            where = f" where the window has k={k} microbatches" if k is not None else ""
            named.append((c, f"each microbatch divided by a fixed accumulation constant K={big_k}{where}"))
    out: list[str] = []
    for value, words in named:
        if value != 1 and close(c, value, tol) and words not in out:
            out.append(words)
    if out and layout is not None:
        # The catalog names W and k; a size of the layout equal to the factor here is as good a reading of it.
        pure = [e for e in wf.search(c, blocks, w, tol, None, layout) if e.fact is None and e.a == 0]
        same = [e for e in pure if e.cost == pure[0].cost]
        if same and same[0].size is not None:  # no product of W and k: a size of the layout is a reading of its own
            out += wf.describe(same, n, layout)
        elif same:
            told = wf.told_apart(same, layout)
            out[0] += f"; {told}" if told else ""
    # Else the window's facts: a count in place of N, an unnormalized sum, a product of W and k the catalog lacks.
    return out or wf.describe(wf.search(c, blocks, w, tol, other_counts, layout), n, layout)


def name_factor(c: float, blocks: Sequence[Block], world_size: int,
                other_counts: Mapping[str, int] | None = None, tolerance: float | None = None,
                layout: wf.Layout | None = None) -> str:
    """What a common scale ``c`` on every weight means, in words, from the window's counts; ``other_counts`` names
    token counts the recipe may have divided by instead (``{"window 0's global count": 800}``). Where the counts
    cannot tell causes apart, the commoner one leads and the others follow as a list; ``layout`` as in
    :func:`factor_readings`."""
    matches = factor_readings(c, blocks, world_size, other_counts, tolerance, layout)
    if len(matches) == 1:
        return matches[0]
    if matches:
        return f"{matches[0]}; the same factor {c:.4g} also reads: " + "; or ".join(matches[1:])
    return (f"every weight is {c:.6g} times the right one: a scale on the loss or the gradient that is no token count "
            "of this window (a loss scale not undone, clipping, a hand-set constant)")


__all__ = ["MAX_CONSTANT", "close", "factor_readings", "microbatches_per_rank", "name_factor"]
