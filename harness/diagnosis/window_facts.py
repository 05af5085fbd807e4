"""The facts of one accumulation window, and the search that names a scale by them.

A normalization mistake divides by the wrong quantity, and the wrong quantity is almost always one the window holds:
the world size W, the microbatch count k, the supervised count N or a part of it (a rank's own count or rows, one
microbatch's), N one token per row off, or N as a low-precision number rounds it (``round_bf16(N)``: a count
all-reduced in bfloat16). A common scale ``c`` on every weight (``c = 1`` is right) is then a short product of these
facts: ``N / W`` (a loss sum never divided by a count, averaged by DDP), ``N / round_bf16(N)``, ``N / (W * n_0)``.

:func:`window_facts` lists the facts of a window from its blocks (the plan's own counts, never constants), and
:func:`search` finds every monomial ``c = N^a * W^b * k^d * X^e`` (X one count of the window) within a tolerance of
``c``, the simplest first. Where two facts are equal in this window (a bf16-rounded count that is also twice one
microbatch's count), both expressions match with the same value: :func:`describe` says so instead of picking one
silently. The rule for which leads: fewer factors, then the vocabulary's order (N's own variants, then a rank's, a
microbatch's, a block's counts, then counts from elsewhere).

This module knows blocks and counts only: :mod:`harness.diagnosis.factor_names` calls it for a common scale, and the
battery's diagnosis adds the facts it alone knows (the objective's quantities, another window's count) and the run's
layout (a :class:`Layout`, :class:`harness.diagnosis.axes.Axes`): each mesh dimension's size, the pipeline's M, A and
chunks, each a factor ``Y`` of a scale ``c = W^b * k^d * Y^f``; where two of those are equal here, the reading names
both and the window that tells them apart.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

MAX_COST = 3
"""Most factors an expression may use (``N / (W * k)`` and ``N / (W * n_r)`` use three). Each added factor multiplies
the expressions a value may match by chance; three keep that chance under about 1 in 500 at a tolerance of 1e-5."""

SEARCH_TOLERANCE = 1e-4
"""Loosest tolerance the search runs at: a scale read less precisely (the bf16 lane's 1e-2) lies within that of
several expressions by chance, and is named by the catalog's few factors alone."""


class Counted(Protocol):
    """A block of the fit (:class:`harness.diagnosis.fit.Block`): one rank's microbatch and its counts."""

    @property
    def rank(self) -> int: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def rows(self) -> int: ...
    def label(self) -> str: ...


@dataclass(frozen=True)
class Fact:
    """One count of the window a recipe may have divided by instead of N."""

    symbol: str
    """How it is written in a formula (``round_bf16(N)``, ``n_1``, ``k*n_m0``)."""
    value: float
    words: str
    """What it is, with its value (``"N rounded to bfloat16 (1248: the count all-reduced or cast in bf16)"``)."""
    cost: int = 1
    """Factors it stands for (``k`` times one microbatch's count: 2)."""


class Layout(Protocol):
    """A run's layout facts (:class:`harness.diagnosis.axes.Axes`)."""

    def facts(self) -> list[Fact]:
        """Sizes a scale may be a product of, beyond ``W`` and ``k`` (a mesh dimension's, ``M``, ``A``)."""
        ...

    def units(self) -> list[Fact]:
        """Counts of the objective's units a recipe may divide by in place of N, beyond the window's own."""
        ...

    def apart(self, a: str, b: str) -> str | None:
        """A window where facts ``a`` and ``b``, equal here, differ (None: none known)."""
        ...


@dataclass(frozen=True)
class Expression:
    """``c = N^a * W^b * k^d * X^e * Y^f``: a scale written in the window's facts (``Y`` a size of the layout)."""

    value: float
    a: int
    b: int
    d: int
    fact: Fact | None
    e: int
    world_size: int
    k: int | None
    n: int = 0
    size: Fact | None = None
    f: int = 0

    @property
    def cost(self) -> int:
        return (abs(self.a) + abs(self.b) + abs(self.d) + (self.fact.cost * abs(self.e) if self.fact else 0)
                + (self.size.cost * abs(self.f) if self.size else 0))

    def symbols(self) -> dict[str, float]:
        """Each fact the expression uses, but N, with its value in this window."""
        out: dict[str, float] = {}
        for sym, power, value in (("W", self.b, self.world_size), ("k", self.d, self.k)):
            if power and value is not None:
                out[sym] = float(value)
        for fact, power in ((self.fact, self.e), (self.size, self.f)):
            if fact is not None and power:
                out[fact.symbol] = fact.value
        return out

    def weight(self, values: bool = False, per_token: bool = True) -> str:
        """The weight every token got, ``c / N``, as a formula (``1/(W*round_bf16(N))``), or with the values; not
        ``per_token``: the scale ``c`` itself (``1/cp``)."""
        powers = [("N", self.a - 1 if per_token else self.a), ("W", self.b), ("k", self.d)]
        for fact, power in ((self.fact, self.e), (self.size, self.f)):
            if fact is not None:
                powers.append((fact.symbol, power))
        shown: dict[str, int | None] = {"N": self.n, "W": self.world_size, "k": self.k}
        for fact in (self.fact, self.size):
            if fact is not None:
                shown[fact.symbol] = int(fact.value) if float(fact.value).is_integer() else None
        up: list[str] = []
        down: list[str] = []
        for sym, p in powers:
            if p == 0:
                continue
            text = sym if not values or shown.get(sym) is None else f"{shown[sym]}"
            text = text if abs(p) == 1 else f"{text}^{abs(p)}"
            (up if p > 0 else down).append(text)
        top = "*".join(up) or "1"
        if not down:
            return top
        bottom = down[0] if len(down) == 1 else "(" + "*".join(down) + ")"
        return f"{top}/{bottom}"

    def meaning(self, n: int) -> str:
        """The expression in words: the divisor the recipe used in place of N, and the factors beside it."""
        fact, k = self.fact, self.k
        if fact is None and self.size is not None:
            return (f"every weight is {self.weight(per_token=False)} = {self.value:.4g} times the right one, "
                    f"{self.size.symbol} being {self.size.words}: the loss scaled by a size of the layout where "
                    "another belongs")
        if fact is None:
            if self.a == 1:
                rest = {(-1, 0): "each rank's loss sum backpropagated as it is, then averaged over the W ranks by DDP",
                        (-1, -1): "each microbatch's loss sum divided by the microbatch count k and by no token "
                                  "count, then averaged over the W ranks by DDP",
                        (0, 0): "the ranks' loss sums added up and never divided"}.get((self.b, self.d))
                head = "the loss was never divided by a token count (an unnormalized loss sum)"
                return f"{head}: {rest}" if rest else head
            if self.a == -1:
                return "the loss was divided by N twice (a mean divided by the count again)"
            return f"every token weighs {self.weight()} instead of 1/N"
        if self.a == 0:
            return f"the loss was divided by N and again by {fact.words}"
        if self.d == -1 and self.b == 0 and fact.symbol.startswith("n_m"):
            return (f"the loss was normalized by k={k} times {fact.words}: a window count estimated from one "
                    f"microbatch, where the window holds N={n}")
        extra = {(0, 0): "", (-1, 0): "; and the world-size factor is missing",
                 (1, 0): "; and multiplied by W once more", (-2, 0): "; and the world-size factor missing twice",
                 (0, -1): "; and divided by k once more", (0, 1): "; and multiplied by k"}.get((self.b, self.d))
        if extra is None:
            extra = f"; every token weighs {self.weight()}"
        return f"the loss was normalized by {fact.words} where the window holds N={n}{extra}"


def _round(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).double())


def _rank_counts(blocks: Sequence[Counted]) -> tuple[dict[int, int], dict[int, int], dict[int, set[int]]]:
    tokens: dict[int, int] = {}
    rows: dict[int, int] = {}
    mbs: dict[int, set[int]] = {}
    for b in blocks:
        rank, mb = b.rank, b.microbatch
        tokens[rank] = tokens.get(rank, 0) + b.tokens
        rows[rank] = rows.get(rank, 0) + b.rows
        mbs.setdefault(rank, set()).add(mb)
    return tokens, rows, mbs


def _ring_sums(per_rank: Mapping[int, int], dtype: torch.dtype) -> list[float]:
    """The sums of the ranks' counts in ``dtype``, each count and partial sum rounded, in every ring order."""
    ranks = sorted(per_rank)
    out = []
    for start in range(len(ranks)):
        for order in (ranks[start:] + ranks[:start], (ranks[start:] + ranks[:start])[::-1]):
            total = 0.0
            for r in order:
                total = _round(total + _round(per_rank[r], dtype), dtype)
            out.append(total)
    return out


def window_facts(blocks: Sequence[Counted], world_size: int,
                 other_counts: Mapping[str, float] | None = None) -> list[Fact]:
    """The counts of this window a recipe may have divided by instead of N, the commoner first: N one token per row
    off and N rounded to a low precision, each rank's own count and rows, each microbatch index's count (k times it
    is a window count estimated from one microbatch), W times the largest rank's count, each block's own count, then
    ``other_counts`` (``{"window 0's global count": 800}``). ``blocks`` are :class:`harness.diagnosis.fit.Block`:
    every microbatch of every rank, with its supervised ``tokens`` and ``rows``."""
    n = sum(b.tokens for b in blocks)
    rows = sum(b.rows for b in blocks)
    per_rank, rows_per_rank, _ = _rank_counts(blocks)
    out: list[Fact] = [Fact("(N+1)", n + 1, f"N plus one ({n + 1} tokens: a count offset by one, an epsilon of 1 "
                                            "against a division by zero)")]
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        long_name = "bfloat16" if name == "bf16" else "float16"
        rounded = _round(n, dtype)
        out.append(Fact(f"round_{name}(N)", rounded, f"N rounded to {long_name} ({rounded:g} tokens: the count "
                                                     f"stored or cast in {name})"))
        # An all-reduce in that dtype rounds each rank's count and every partial sum, in an order of the backend's
        # own (a ring starts anywhere and runs either way): each such order's sum is a fact.
        for total in sorted(set(_ring_sums(per_rank, dtype)) - {rounded}):
            out.append(Fact(f"allreduce_{name}(n_r)", total, f"the ranks' counts all-reduced in {long_name} "
                                                             f"({total:g} tokens: each count and each partial sum "
                                                             "rounded)"))
    out.append(Fact("(N-1)", n - 1, f"N minus one ({n - 1} tokens)"))
    if rows:
        out += [Fact("(N+R)", n + rows, f"N plus one token per row ({n + rows} tokens: the labels counted before the "
                                        "shift, or a padding token counted per row)"),
                Fact("(N-R)", n - rows, f"N minus one token per row ({n - rows} tokens: one label per row dropped "
                                        "from the count)"),
                Fact("R", rows, f"the window's row count (R={rows} sequences: a count of rows, not tokens)")]
    if world_size > 1:
        for r, nr in sorted(per_rank.items()):
            out.append(Fact(f"n_{r}", nr, f"rank {r}'s local count ({nr} tokens)"))
        for r, rr in sorted(rows_per_rank.items()):
            if rr:
                out.append(Fact(f"rows_{r}", rr, f"rank {r}'s row count ({rr} rows)"))
        top = max(per_rank.values())
        out.append(Fact("W*max(n_r)", world_size * top, f"W times the largest rank's count ({world_size} x {top} "
                                                        "tokens)", cost=2))
    by_index: dict[int, int] = {}
    for b in blocks:
        by_index[b.microbatch] = by_index.get(b.microbatch, 0) + b.tokens
    for m, nm in sorted(by_index.items()):
        out.append(Fact(f"n_m{m}", nm, f"microbatch {m}'s count over every rank ({nm} tokens)"))
    if len(blocks) > 1:
        for b in blocks:
            out.append(Fact(f"n_r{b.rank}m{b.microbatch}", b.tokens,
                            f"{b.label()}'s own count ({b.tokens} tokens)"))
    for what, count in (other_counts or {}).items():
        out.append(Fact(f"[{what}]", float(count), f"{what} ({count:g} tokens)"))
    return [f for f in out if f.value > 0 and f.value != n]


def _k(blocks: Sequence[Counted]) -> int | None:
    _, _, mbs = _rank_counts(blocks)
    ks = {len(m) for m in mbs.values()}
    return next(iter(ks)) if len(ks) == 1 else None


def search(c: float, blocks: Sequence[Counted], world_size: int, tolerance: float,
           other_counts: Mapping[str, float] | None = None, layout: Layout | None = None) -> list[Expression]:
    """Every expression ``N^a * W^b * k^d * X^e`` of at most :data:`MAX_COST` factors within ``tolerance``
    (relative) of ``c``, and with ``layout`` every factor ``W^b * k^d * Y^f`` (``Y`` one of its sizes, the units
    among the counts ``X``), the simplest first (then the vocabulary's order, a size of the layout after ``W`` and
    ``k``); none when ``tolerance`` is looser than :data:`SEARCH_TOLERANCE` or ``c`` is not a positive number."""
    if not (math.isfinite(c) and c > 0) or tolerance > SEARCH_TOLERANCE:
        return []
    n = sum(b.tokens for b in blocks)
    if n <= 0:
        return []
    k = _k(blocks)
    facts: list[Fact | None] = [None, *window_facts(blocks, world_size, other_counts),
                                *(layout.units() if layout is not None else [])]
    sizes: list[Fact | None] = [None, *(layout.facts() if layout is not None else [])]
    w_powers = range(-2, 3) if world_size > 1 else range(1)
    k_powers = range(-1, 2) if k is not None and k > 1 else range(1)
    found: list[tuple[int, int, float, Expression]] = []
    for order, fact in enumerate(facts):
        # Shapes a recipe writes: no count (an unnormalized sum N/..., a factor, N divided twice), or one count X in
        # place of N (N/X) or beside it (1/X: the mean divided again); X in a numerator names no mistake.
        shapes = ((1, -1), (0, -1)) if fact else ((1, 0), (0, 0), (-1, 0))
        for (a, e), b, d, size in itertools.product(shapes, w_powers, k_powers, sizes):
            if a == 0 and fact is not None and (b or d):
                continue  # a mean divided again by a count, times W or k: no shape a recipe writes
            if size is not None and (fact is not None or a != 0):
                continue  # a size of the layout is a factor on the right loss, not a count
            for f in (-2, -1, 1, 2) if size is not None else (0,):
                expr = Expression(0.0, a, b, d, fact, e, world_size, k, n, size, f)
                if expr.cost == 0 or expr.cost > MAX_COST:
                    continue
                value = (float(n) ** a * float(world_size) ** b * float(k or 1) ** d
                         * (fact.value ** e if fact else 1.0) * (size.value ** f if size else 1.0))
                if value != 1 and abs(c / value - 1) <= tolerance:
                    found.append((expr.cost, order, abs(c / value - 1), Expression(value, a, b, d, fact, e,
                                                                                  world_size, k, n, size, f)))
    # The simplest first; among equals, the vocabulary's order, a layout's size after W and k, then a factor of W
    # before one of k (commoner).
    found.sort(key=lambda t: (t[0], t[1], t[3].size is not None, abs(t[3].d), t[2]))
    return [t[3] for t in found]


def told_apart(same: Sequence[Expression], layout: Layout | None) -> str:
    """For expressions of one value: each fact one of them uses where another uses a fact of the same value, named
    with the window where the two differ (``"k=2, dp=2 and cp=2 are equal in this window, so the factor reads as any
    of them; a window where they differ tells them apart: scenario long at mesh dp=2,cp=2, where k=5 (k from dp, k
    from cp); mesh dp=3,cp=2 (dp from cp)"``); empty where there are none or no layout says where."""
    if layout is None or len(same) < 2:
        return ""
    used = [e.symbols() for e in same[:5]]
    equal: dict[float, list[str]] = {}
    where: dict[str, list[str]] = {}
    for i, x in enumerate(used):
        for y in used[i + 1:]:
            for a, b in ((a, b) for a in x if a not in y for b in y if b not in x and y[b] == x[a]):
                at = layout.apart(a, b)
                if at is None or f"{a} from {b}" in where.get(at, []):
                    continue
                where.setdefault(at, []).append(f"{a} from {b}")
                for sym in (a, b):
                    if sym not in equal.setdefault(x[a], []):
                        equal[x[a]].append(sym)
    if not where:
        return ""
    sets = "; ".join(", ".join(f"{s}={v:g}" for s in syms[:-1]) + f" and {syms[-1]}={v:g}"
                     for v, syms in equal.items())
    told = "; ".join(f"{at} ({', '.join(what)})" for at, what in where.items())
    return (f"{sets} are equal in this window, so the factor reads as any of them; a window where they differ tells "
            f"them apart: {told}")


def describe(found: Sequence[Expression], n: int, layout: Layout | None = None) -> list[str]:
    """One reading per value among the expressions found (the simplest first), each with its formula in symbols and
    in numbers. Expressions of the same value are one reading: the first leads, and the others with as few factors are
    named as what the same number also means in this window, since its counts alone cannot tell them apart (one with
    more factors is left out: the simpler cause is the likelier); with ``layout``, each pair of equal facts is named
    with the window that tells them apart (:func:`told_apart`)."""
    groups: dict[float, list[Expression]] = {}
    for expr in found:
        same = groups.setdefault(expr.value, [])
        if not same or expr.cost == same[0].cost:  # a same number with more factors is the less likely reading
            same.append(expr)
    out = []
    for same in groups.values():
        lead = same[0]
        text = (f"{lead.meaning(n)} (every token weighs {lead.weight()} = {lead.weight(values=True)} where 1/N is "
                "right)")
        if len(same) > 1:
            also = "; ".join(x.weight() + ("" if x.fact is None or x.fact == lead.fact else
                                           f", {x.fact.symbol} being {x.fact.words}") for x in same[1:5])
            more = f" and {len(same) - 5} more" if len(same) > 5 else ""
            text += (f"; in this window the same number is also {also}{more}: these counts are equal here, so they "
                     "cannot tell those causes apart (the reading with the fewest factors leads)")
            told = told_apart(same, layout)
            text += f"; {told}" if told else ""
        out.append(text)
    return out


__all__ = ["MAX_COST", "SEARCH_TOLERANCE", "Expression", "Fact", "Layout", "describe", "search", "told_apart",
           "window_facts"]
