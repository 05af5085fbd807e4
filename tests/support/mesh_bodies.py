"""Rank bodies for the device-mesh tests: what torch's DeviceMesh builds on real ranks, for the parent to compare
with :mod:`harness.core.mesh`."""

from __future__ import annotations

import itertools

import torch.distributed as dist

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
