"""Rank bodies for the device-mesh tests: what torch's DeviceMesh builds on real ranks, for the parent to compare
with :mod:`harness.core.mesh`."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.core.mesh import Mesh
from harness.distributed.device_mesh import RankMesh


def groups(mesh: Mesh) -> dict[str, object]:
    """This rank's global rank and, for every non-empty set of the mesh's dimensions, the ranks of the group a
    reduction over them spans (as DeviceMesh builds it, flattened where several)."""
    ranks = RankMesh(mesh, "cpu")
    out: dict[str, object] = {"rank": dist.get_rank()}
    for n in range(1, len(mesh.names) + 1):
        for dims in itertools.combinations(mesh.names, n):
            out[",".join(dims)] = ranks.ranks(dims)
    return out


def hsdp(mesh: Mesh) -> dict[str, object]:
    """What FSDP2 shards over on this rank of ``mesh``: the names and groups of the mesh the rank program passes the
    strategy, the placements of a parameter sharded over it, and the group of the shard dimensions flattened by a
    recipe afterwards (the flattened name torchtitan uses is taken by the 2-D mesh's second dimension)."""
    from harness.battery.rank.rank_program import mesh_of_reduction
    from harness.distributed.device_mesh import flattened
    from harness.distributed.strategies import get

    ranks = RankMesh(mesh, "cpu")
    two: Any = mesh_of_reduction(ranks, "fsdp2")
    flat: Any = mesh_of_reduction(ranks, "ddp")
    model = nn.Linear(4, 4)
    get("fsdp2").wrap(model, torch.device("cpu"), mesh=two)
    weight: Any = model.weight
    shard = tuple(d for d in mesh.token_dims if d != "dp_replicate")
    return {"rank": dist.get_rank(), "names": tuple(two.mesh_dim_names),
            "replicate": tuple(dist.get_process_group_ranks(two.get_group(0))),
            "shard": tuple(dist.get_process_group_ranks(two.get_group(1))),
            "ddp": tuple(dist.get_process_group_ranks(flat.get_group())),
            "placements": tuple(type(p).__name__ for p in weight.placements),
            "shard_again": tuple(dist.get_process_group_ranks(flattened(ranks.device_mesh, shard).get_group()))}
