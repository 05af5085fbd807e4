"""The scenarios of a run over a device mesh: the battery's own, built for the mesh's data ranks, and those only a mesh
has, where the cp shards of one data coordinate (:mod:`harness.data.context_parallel`) hold chosen counts.

- ``cp_balanced``: every token rank (each dp coordinate's each cp shard) holds the same count, so a count reduced over
  a wrong group shows as an exact factor: the group's share of the window;
- ``one_token``: one supervised token in the whole window, on the last token rank (a shard's own count is then the
  window's on one rank and nothing on the others);
- ``empty_shard``: the last cp shard of data rank 0 holds no token, every other shard as in ``uneven`` (a shard that
  divides by its own count divides by zero);

and the base scenario ``uneven`` already gives cp shards unequal counts (its prompts sit in the first chunk, its
padding in the last), ``one_empty`` an empty dp coordinate.

A pipeline (pp > 1) drives a window as A schedule steps (``--pp-steps``), each taking at least one of the window's
microbatches, so its scenarios hold :data:`PP_WINDOW` microbatches per data rank, enough for A = 1, 2 or 3:

- ``pp_uneven``: the uneven draw (unequal rows, lengths and counts per rank and microbatch);
- ``pp_balanced``: every data rank the same count, microbatch by microbatch (a count taken from one step, or one
  data rank, is then exact: what the uneven one exists to show);
- ``pp_empty_step``: ``pp_uneven`` with data rank 0's first microbatch and the last data rank's last one holding no
  supervised token: the first schedule step at A = 2 or 3 holds none on rank 0, the last at A = 3 none on the last
  data rank, and every stage must still step (a stage that skips a step leaves its peers waiting on a send).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from harness.battery import scenarios
from harness.battery.scenarios import Windows
from harness.core.mesh import Mesh
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.data.context_parallel import positions


def _held(mb: Microbatch, cp_rank: int, cp: int, chunking: str) -> torch.Tensor:
    """Where cp rank ``cp_rank`` holds a supervised label of ``mb``: a bool mask of its labels' shape."""
    where = positions(mb.labels.shape[1], cp_rank, cp, chunking)
    return (mb.labels != IGNORE_INDEX) & where.unsqueeze(0)


def _masked(mb: Microbatch, drop: torch.Tensor) -> Microbatch:
    labels = torch.where(drop, torch.full_like(mb.labels, IGNORE_INDEX), mb.labels)
    return Microbatch(mb.inputs, labels, None if mb.weights is None else torch.where(drop, 0.0, mb.weights))


def cp_balanced(mesh: Mesh, chunking: str) -> Windows:
    """The balanced window (every data rank the same rows' shapes), with each microbatch's cp shards cut down to the
    smallest one's count: the last supervised positions of a larger shard are masked. Every token rank then holds
    one count, microbatch by microbatch."""
    cp = mesh.size("cp")
    window = scenarios.balanced(mesh.data_ranks)[0]
    out = []
    for rank in window:
        mine = []
        for mb in rank:
            held = [_held(mb, c, cp, chunking) for c in range(cp)]
            least = min(int(h.sum()) for h in held)
            drop = torch.zeros_like(mb.labels, dtype=torch.bool)
            for h in held:
                extra = int(h.sum()) - least
                if extra:
                    flat = h.flatten().nonzero().flatten()[-extra:]
                    drop.view(-1)[flat] = True
            mine.append(_masked(mb, drop))
        out.append(mine)
    if any(m.supervised == 0 for rank in out for m in rank):
        msg = f"mesh {mesh.label}: a balanced window leaves a microbatch without tokens; use a smaller cp"
        raise ValueError(msg)
    return [out]


def one_token(mesh: Mesh, chunking: str) -> Windows:
    """The uneven window with a single supervised token: the last one of the last data rank's last microbatch, in
    its last cp shard (every other label masked)."""
    window = scenarios.uneven(mesh.data_ranks)[0]
    cp = mesh.size("cp")
    last = window[-1][-1]
    held = _held(last, cp - 1, cp, chunking)
    keep = torch.zeros_like(held)
    keep.view(-1)[held.flatten().nonzero().flatten()[-1]] = True
    window = [[scenarios.unsupervised(mb) for mb in rank] for rank in window]
    window[-1][-1] = _masked(last, ~keep)
    return [window]


def empty_shard(mesh: Mesh, chunking: str) -> Windows:
    """The uneven window with data rank 0's last cp shard holding no token (its positions masked in every
    microbatch); every other shard keeps its tokens."""
    cp = mesh.size("cp")
    window = scenarios.uneven(mesh.data_ranks)[0]
    window[0] = [_masked(mb, _held(mb, cp - 1, cp, chunking)) for mb in window[0]]
    return [window]


PP_WINDOW = 3
"""Microbatches per data rank in a pipeline scenario's window: the most schedule steps (``--pp-steps``) it takes."""


def pp_uneven(mesh: Mesh, chunking: str) -> Windows:
    """One window of :data:`PP_WINDOW` microbatches of about 3 rows per data rank, drawn as ``uneven`` is."""
    return scenarios.plan_windows(mesh.data_ranks, [PP_WINDOW], rows_per_microbatch=3, seed_offset=5)


def pp_balanced(mesh: Mesh, chunking: str) -> Windows:
    """The balanced window with :data:`PP_WINDOW` microbatches of 3 rows per data rank."""
    return scenarios.balanced(mesh.data_ranks, PP_WINDOW, 3)


def pp_empty_step(mesh: Mesh, chunking: str) -> Windows:
    """``pp_uneven`` with no supervised token in data rank 0's first microbatch and the last data rank's last one
    (both on rank 0 at dp = 1, its middle microbatch supervised): the count is the window's, and a step that holds
    none still runs forward and backward on every stage."""
    window = pp_uneven(mesh, chunking)[0]
    window[0][0] = scenarios.unsupervised(window[0][0])
    window[-1][-1] = scenarios.unsupervised(window[-1][-1])
    return [window]


MESH_SCENARIOS: dict[str, tuple[Callable[[Mesh, str], Windows], Callable[[Mesh], bool]]] = {
    "cp_balanced": (cp_balanced, lambda m: m.size("cp") > 1),
    "one_token": (one_token, lambda m: len(m.names) > 1),
    "empty_shard": (empty_shard, lambda m: m.size("cp") > 1),
    "pp_uneven": (pp_uneven, lambda m: m.size("pp") > 1),
    "pp_balanced": (pp_balanced, lambda m: m.size("pp") > 1),
    "pp_empty_step": (pp_empty_step, lambda m: m.size("pp") > 1),
}
"""Each mesh scenario's builder and the meshes it is offered on."""


def for_mesh(mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh scenarios a run over ``mesh`` goes through (none without a mesh)."""
    if mesh is None:
        return ()
    return tuple(name for name, (_, offered) in MESH_SCENARIOS.items() if offered(mesh))


def build(name: str, mesh: Mesh, chunking: str = "contiguous") -> Windows:
    """The windows of scenario ``name`` for ``mesh``: a battery scenario for its data ranks, or a mesh scenario
    (ValueError where the mesh has no use for it)."""
    if name not in MESH_SCENARIOS:
        return scenarios.build(name, mesh.data_ranks)
    fn, offered = MESH_SCENARIOS[name]
    if not offered(mesh):
        need, example = (("pp > 1", "dp=2,pp=2") if name.startswith("pp_") else
                         ("cp > 1", "dp=2,cp=2") if name != "one_token" else ("two dimensions or more", "dp=2,cp=2"))
        msg = f"scenario={name!r} needs a mesh with {need} (got {mesh.label}); give --mesh, e.g. {example}"
        raise ValueError(msg)
    return fn(mesh, chunking)


@lru_cache(maxsize=16)
def microbatch_counts(mesh: Mesh, chunking: str = "contiguous") -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each scenario a run over ``mesh`` goes through (the battery's, then the mesh's own), with its windows'
    microbatch counts per data rank: where the microbatch count k of one window equals a size of the mesh, the
    diagnosis names the scenario whose k differs (:class:`harness.diagnosis.axes.Axes`)."""
    names = [n for n in scenarios.BATTERY_SCENARIOS if mesh.data_ranks > 1 or n not in scenarios.MULTI_RANK_ONLY]
    out = []
    for name in (*names, *for_mesh(mesh)):
        windows = build(name, mesh, chunking)
        out.append((name, tuple(len(window[0]) for window in windows)))
    return tuple(out)


__all__ = ["MESH_SCENARIOS", "PP_WINDOW", "build", "cp_balanced", "empty_shard", "for_mesh", "microbatch_counts",
           "one_token", "pp_balanced", "pp_empty_step", "pp_uneven"]
