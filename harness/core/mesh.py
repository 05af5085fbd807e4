"""The layout of a run's ranks: which dimensions of parallelism there are, which ranks share data, and which group a
count or a gradient is reduced over. One value (:class:`Mesh`) that every stage of a battery run reads, from the
plan to the diagnosis, rather than a world size and a set of group arguments threaded through each.

Dimensions, outer to inner, in torchtitan's names: ``pp`` (pipeline stages), ``dp_replicate`` and ``dp_shard``
(HSDP's two data-parallel dimensions; ``dp`` when data parallelism is one dimension), ``cp`` (context parallel: the
ranks of one data coordinate split the positions of its sequences) and ``tp`` (tensor parallel: the ranks of one
data coordinate hold the same tokens). ``ep`` (expert parallel) is a data dimension, torchtitan's "borrowed from the
data dimensions": its ranks receive distinct windows like dp's, and each holds a share of a mixture-of-experts
model's experts (``--mesh dp=2,ep=2``: 4 data ranks; dense parameters reduce over all 4, expert parameters over the
2 ranks holding the same experts, the expert-data group :attr:`Mesh.expert_data_dims`); it sits between dp and cp.
Ranks are numbered row-major over the dimensions in that order, the last one fastest, as
``torch.distributed.device_mesh.init_device_mesh`` numbers them.

Pure Python: the options and the plan read it without importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DIMS = ("pp", "dp_replicate", "dp_shard", "dp", "ep", "cp", "tp")
"""Every dimension a mesh may have, outer to inner."""

DATA_DIMS = ("dp_replicate", "dp_shard", "dp", "ep")
"""The dimensions whose ranks receive distinct windows: the data-parallel ones, and ``ep``, whose ranks hold distinct
experts and distinct tokens."""

CHUNKINGS = ("contiguous", "load_balanced")
"""How the cp ranks of one data coordinate split its positions (:mod:`harness.data.context_parallel`)."""

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzb")
"""The pipeline schedules a mesh with ``pp`` runs under (``--pp-schedule``; the ``torch.distributed.pipelining``
classes are named in :mod:`harness.distributed.pipeline`)."""

MULTI_STAGE_SCHEDULES = ("interleaved1f1b", "loopedbfs", "interleavedzb")
"""The schedules that run several stages per pp rank."""

REFUSED_PP_SCHEDULES = {
    "interleavedzb": "its weight backward (torch.autograd.grad, the result assigned to .grad) bypasses DDP's reducer "
                     "hooks and FSDP2's reduce-scatter, so a stage's gradients over dp are never reduced (at "
                     "dp=2,pp=2 one stage synchronizes 0 times and parity fails); use interleaved1f1b, the same "
                     "placement of 2 stages per rank",
}
"""The schedules of :data:`PP_SCHEDULES` the harness refuses (``--pp-schedule``), with why."""

TOKEN_DIMS = (*DATA_DIMS, "cp")
"""The dimensions a token count is reduced over: each supervised token lies in exactly one coordinate of these (the
cp ranks of one data coordinate split its positions; tp and pp ranks hold the same tokens)."""


@dataclass(frozen=True)
class Mesh:
    """A run's ranks as a grid: ``dims`` is ``((name, size), ...)`` in :data:`DIMS` order, sizes at least 1."""

    dims: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.dims]
        unknown = [n for n in names if n not in DIMS]
        if unknown:
            msg = f"mesh dimension {unknown[0]!r} is not one of {', '.join(DIMS)}"
            raise ValueError(msg)
        if len(set(names)) != len(names):
            msg = f"mesh {self.label} names a dimension twice"
            raise ValueError(msg)
        if "dp" in names and ({"dp_replicate", "dp_shard"} & set(names)):
            msg = (f"mesh {self.label} mixes dp with dp_replicate/dp_shard: name dp alone, or split it into "
                   "dp_replicate and dp_shard (HSDP)")
            raise ValueError(msg)
        bad = [(n, s) for n, s in self.dims if isinstance(s, bool) or not isinstance(s, int) or s < 1]
        if bad:
            msg = f"mesh dimension {bad[0][0]}={bad[0][1]!r} must be a positive number of ranks"
            raise ValueError(msg)
        if names != sorted(names, key=DIMS.index):
            object.__setattr__(self, "dims", tuple(sorted(self.dims, key=lambda d: DIMS.index(d[0]))))
        if not self.dims:
            msg = "a mesh needs at least one dimension (e.g. dp=2)"
            raise ValueError(msg)

    @classmethod
    def data_parallel(cls, world_size: int) -> Mesh:
        """The one-dimensional layout: every rank its own data (``dp=W``)."""
        return cls((("dp", world_size),))

    @classmethod
    def parse(cls, text: str, argument: str = "--mesh") -> Mesh:
        """``"dp=2,cp=2"`` as a mesh; ValueError naming ``argument``, the value and the fix."""
        dims = []
        for part in (p.strip() for p in str(text).split(",")):
            name, sep, size = part.partition("=")
            if not sep or not size.strip().isdigit():
                msg = (f"{argument}={text!r}: {part!r} is not NAME=SIZE; write the sizes of the dimensions, e.g. "
                       f"{argument} dp=2,cp=2 (names: {', '.join(DIMS)})")
                raise ValueError(msg)
            dims.append((name.strip(), int(size)))
        try:
            return cls(tuple(dims))
        except ValueError as exc:
            msg = f"{argument}={text!r}: {exc}"
            raise ValueError(msg) from None

    @property
    def label(self) -> str:
        """``"dp=2,cp=2"``: the form :meth:`parse` reads."""
        return ",".join(f"{name}={size}" for name, size in self.dims)

    @property
    def stem(self) -> str:
        """``"dp2xcp2"``: the label as it goes into a test id or a file name."""
        return "x".join(f"{name}{size}" for name, size in self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.dims)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, dim: str) -> int:
        """The size of ``dim`` (1 when the mesh does not have it)."""
        return dict(self.dims).get(dim, 1)

    @property
    def data_ranks(self) -> int:
        """How many distinct windows one window of the run holds: the product of the data-parallel sizes."""
        return math.prod(self.size(d) for d in DATA_DIMS)

    @property
    def token_dims(self) -> tuple[str, ...]:
        """The mesh's dimensions a count must be reduced over (:data:`TOKEN_DIMS` it has)."""
        return tuple(n for n in self.names if n in TOKEN_DIMS)

    @property
    def expert_data_dims(self) -> tuple[str, ...]:
        """The dimensions an expert parameter's gradient is reduced over: the token dimensions less ``ep`` (the ranks
        holding the same experts). Its divide factor is still the whole token group's size (:attr:`token_ranks`):
        the expert's gradient is a term of the same mean over every token."""
        return tuple(n for n in self.token_dims if n != "ep")

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on each dimension."""
        if not 0 <= rank < self.world_size:
            msg = f"rank {rank} is outside mesh {self.label} ({self.world_size} ranks)"
            raise ValueError(msg)
        out = {}
        for name, size in reversed(self.dims):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.names}

    def rank_at(self, coords: dict[str, int]) -> int:
        """The rank at ``coords`` (a dimension left out: coordinate 0)."""
        rank = 0
        for name, size in self.dims:
            rank = rank * size + coords.get(name, 0)
        return rank

    def data_rank(self, rank: int) -> int:
        """Which of the window's :attr:`data_ranks` windows ``rank`` trains on (row-major over the data dimensions)."""
        c = self.coords(rank)
        index = 0
        for name in DATA_DIMS:
            index = index * self.size(name) + c.get(name, 0)
        return index

    @property
    def token_ranks(self) -> int:
        """How many ranks hold distinct supervised tokens: the product of the :attr:`token_dims` sizes (dp x cp)."""
        return math.prod(self.size(d) for d in TOKEN_DIMS)

    def token_rank(self, rank: int) -> int:
        """Which of the :attr:`token_ranks` ``rank``'s tokens are (row-major over the token dimensions: its data
        rank, then its cp coordinate); the tp and pp ranks of one coordinate share it."""
        return self.data_rank(rank) * self.size("cp") + self.coords(rank).get("cp", 0)

    def holder(self, token_rank: int) -> int:
        """The first rank (tp and pp coordinate 0) that holds the tokens of ``token_rank``."""
        data, cp = divmod(token_rank, self.size("cp"))
        coords: dict[str, int] = {"cp": cp}
        for name in reversed(DATA_DIMS):
            data, coords[name] = divmod(data, self.size(name))
        return self.rank_at(coords)

    def group(self, rank: int, dims: Sequence[str]) -> tuple[int, ...]:
        """The ranks a reduction over ``dims`` spans from ``rank``: those that differ from it on ``dims`` only
        (a dimension the mesh lacks spans one rank)."""
        c = self.coords(rank)
        return tuple(r for r in range(self.world_size)
                     if all(v == c[name] for name, v in self.coords(r).items() if name not in dims))

    def groups(self, dims: Sequence[str]) -> list[tuple[int, ...]]:
        """Every group a reduction over ``dims`` forms: a partition of the ranks."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(self.group(r, dims), None)
        return list(seen)
