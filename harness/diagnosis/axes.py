"""The facts of a run's layout that a common scale may be a product of, beside the window's counts.

A recipe written for one layout scales its loss by a size it knows: the data-parallel size where the token group's
belongs, the microbatch count where cp's belongs. So a common scale ``c`` on every weight is named by the mesh's facts
as well as the window's (:mod:`harness.diagnosis.window_facts`): each dimension's size (dp, cp, tp, pp,
dp_replicate, dp_shard), the data group's size ``D`` and the other products of the sizes, the pipeline's ``M``
(microbatches per schedule step), ``A`` (schedule steps per window) and ``V`` (stages per pp rank, the schedule's
chunks), and among the objective's units the window's microbatches over the data group ``K = k x D``.

Where two facts are equal in a window (``k = 2`` and ``cp = 2`` on the base scenario at dp=2,cp=2) a reading by one is
a reading by the other: :meth:`Axes.apart` names a window where they differ (another scenario of the battery at this
mesh, another mesh, another schedule), and :func:`coincidences` finds the pairs a family of windows never tells apart
(``tests/unit/test_window_axes.py`` holds every mesh and pipeline family the battery runs to it).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from harness.core.mesh import Mesh
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.window_facts import Fact

RUN_OPTIONS = {"M": "--pp-microbatches", "A": "--pp-steps", "V": "--pp-schedule"}
"""The facts a run's options set, with the option that changes each."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Axes:
    """One window's layout: its mesh, microbatches per data rank, and pipeline schedule."""

    mesh: Mesh
    k: int | None = None
    """Microbatches per data rank in the window (None: the data ranks hold different counts)."""
    microbatches: int | None = None
    """``M``: the microbatches of each schedule step (None: no pipeline, or steps of different M)."""
    steps: int | None = None
    """``A``: the schedule steps of the window (None: no pipeline)."""
    chunks: int = 1
    """``V``: the stages each pp rank holds (2 under the interleaved and looped schedules)."""
    elsewhere: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """The battery's scenarios at this mesh, each with its windows' microbatch counts per data rank: where ``k``
    equals another fact here, the first whose ``k`` differs tells the two apart."""

    def dims_of(self) -> dict[str, frozenset[str]]:
        """Each mesh fact's symbol and the dimensions it is the product of: ``W`` the token group, each dimension of
        size over 1, ``D`` the data group where it has two dimensions, and every other product (``dp*tp``)."""
        live = [n for n in self.mesh.names if self.mesh.size(n) > 1]
        token = frozenset(d for d in self.mesh.token_dims if d in live)
        data = frozenset(d for d in live if d in ("dp_replicate", "dp_shard", "dp"))
        out: dict[str, frozenset[str]] = {"W": token} if token else {}
        for size in range(1, len(live) + 1):
            for dims in itertools.combinations(live, size):
                group = frozenset(dims)
                if group in out.values():
                    continue  # the token group is W
                out["D" if group == data and size > 1 else "*".join(dims)] = group
        return out

    def sizes(self) -> dict[str, int]:
        """Every fact of the layout over 1, by symbol: ``k``, ``W`` and the mesh's, ``M``, ``A``, ``V``."""
        out = {sym: math.prod(self.mesh.size(d) for d in dims) for sym, dims in self.dims_of().items()}
        for sym, value in (("k", self.k), ("M", self.microbatches), ("A", self.steps), ("V", self.chunks)):
            if value is not None and value > 1:
                out[sym] = value
        return out

    def facts(self) -> list[Fact]:
        """The sizes a scale may be a product of, beyond ``W`` and ``k`` (the search's own): each as a
        :class:`~harness.diagnosis.window_facts.Fact` of as many factors as dimensions it multiplies."""
        dims = self.dims_of()
        words = {"M": "the microbatches per schedule step", "A": "the schedule steps per window",
                 "V": "the stages per pp rank (the schedule's chunks)", "D": "the data group's size"}
        out = []
        for sym, value in self.sizes().items():
            if sym in ("W", "k"):
                continue
            what = words.get(sym) or (f"{sym}'s size" if "*" not in sym else f"the size of {sym.replace('*', ' x ')}")
            out.append(Fact(sym, float(value), f"{what} ({sym}={value})", cost=max(1, len(dims.get(sym, ())))))
        return out

    def units(self) -> list[Fact]:
        """The objective's units a recipe may have divided by in place of N, beyond tokens and rows (the window
        facts' own): the window's microbatches over the data group, ``K = k x D``."""
        data = self.mesh.data_ranks
        if self.k is None or self.k * data < 2:
            return []
        return [Fact("K", float(self.k * data), f"the window's microbatches over the data group (K = k x D = "
                                                f"{self.k} x {data})")]

    def apart(self, a: str, b: str) -> str | None:
        """Where facts ``a`` and ``b``, equal here, differ: a scenario of the battery at this mesh whose ``k`` is
        another, a run with another option, or a mesh with one of their dimensions one larger (None: neither is a
        fact of this layout)."""
        sizes, dims = self.sizes(), self.dims_of()
        if a not in sizes or b not in sizes:
            return None
        if "k" in (a, b):
            other = sizes[b if a == "k" else a]
            # A scenario whose k is another count over 1 first: at k = 1 a factor of k is no factor at all.
            differ = sorted(((k <= 1, name, k) for name, ks in self.elsewhere for k in ks if k != other),
                            key=lambda t: t[0])
            if differ:
                return f"scenario {differ[0][1]} at mesh {self.mesh.label}, where k={differ[0][2]}"
        for sym in (a, b):
            if sym in RUN_OPTIONS:
                return f"a run with another {RUN_OPTIONS[sym]} ({sym}={sizes[sym]} here)"
        diff = sorted(dims.get(a, frozenset()) ^ dims.get(b, frozenset()), key=self.mesh.names.index)
        if not diff:
            return None
        grown = Mesh(tuple((n, s + 1 if n == diff[0] else s) for n, s in self.mesh.dims))
        return f"mesh {grown.label}"


def axes_of(ev: Evidence, window: int, rank: int) -> Axes:
    """The layout of ``window`` of ``ev`` as rank ``rank`` ran it (its schedule steps from its record)."""
    ks = {len(mbs) for mbs in ev.windows[window]}
    m: int | None = None
    a: int | None = None
    records = ev.records
    if records is not None and rank < len(records) and window < len(records[rank]):
        steps = records[rank][window].pipeline_steps
        if steps:
            a = len(steps)
            ms = {s.n_microbatches for s in steps}
            m = next(iter(ms)) if len(ms) == 1 else None
    return Axes(mesh=ev.mesh, k=next(iter(ks)) if len(ks) == 1 else None, microbatches=m, steps=a,
                chunks=ev.stages_per_rank, elsewhere=ev.other_scenarios)


def coincidences(cases: Sequence[Mapping[str, int]], symbols: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """The pairs of facts (among ``symbols``, default every one) that hold one value in every case where both are
    facts (:meth:`Axes.sizes`: a group of the mesh is one symbol, so a fact is never paired with itself): a reading by
    one of them could not be told from a reading by the other anywhere in the family."""
    seen = sorted({s for case in cases for s in case if symbols is None or s in symbols})
    out = []
    for a, b in itertools.combinations(seen, 2):
        both = [(case[a], case[b]) for case in cases if a in case and b in case]
        if both and all(x == y for x, y in both):
            out.append((a, b))
    return out


__all__ = ["RUN_OPTIONS", "Axes", "axes_of", "coincidences"]
