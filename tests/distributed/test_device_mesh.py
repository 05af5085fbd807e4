"""The run's layout on real ranks: torch's DeviceMesh forms the groups :mod:`harness.core.mesh` computes in the
parent, for every set of dimensions, flattened where several (``harness.distributed.device_mesh``)."""

from __future__ import annotations

import functools

import pytest
from support import mesh_bodies

from harness.core.mesh import Mesh
from harness.distributed.launcher import launch


@functools.cache
def groups_on_ranks(shape: str) -> list[dict[str, object]]:
    """What DeviceMesh built on 4 real ranks for ``shape`` (one launch per shape and process)."""
    return launch(mesh_bodies.groups, 4, Mesh.parse(shape), deadline=60, preload=("support.mesh_bodies",))


def disagreements(mesh: Mesh, seen: list[dict[str, object]]) -> list[str]:
    """``rank r over dims: torch [..] vs mesh [..]`` for each group torch built that ``mesh`` computes otherwise."""
    out = []
    for got in seen:
        rank = int(got["rank"])  # type: ignore[call-overload]
        for key, ranks in got.items():
            if key == "rank":
                continue
            want = mesh.group(rank, key.split(","))
            if tuple(ranks) != want:  # type: ignore[call-overload]
                out.append(f"rank {rank} over {key}: torch {ranks} vs mesh {want}")
    return out


@pytest.mark.parametrize("shape", ["dp=2,cp=2", pytest.param("dp=2,tp=2", marks=pytest.mark.slow),
                                   pytest.param("dp_replicate=2,dp_shard=2", marks=pytest.mark.slow)])
def test_device_mesh_forms_the_groups_the_layout_computes(shape: str) -> None:
    """At W=4, every dimension's group and every flattened pair's, on every rank, are the layout's."""
    assert [] == disagreements(Mesh.parse(shape), groups_on_ranks(shape))


def test_the_comparison_rejects_a_layout_numbered_the_other_way() -> None:
    """Its negative control: the groups torch builds for dp=2,cp=2 are not those of cp=2,dp=2 read as dp outer."""

    class CpOuter(Mesh):
        def coords(self, rank: int) -> dict[str, int]:
            return {"dp": rank % 2, "cp": rank // 2}

    wrong = disagreements(CpOuter(Mesh.parse("dp=2,cp=2").dims), groups_on_ranks("dp=2,cp=2"))
    assert "rank 1 over dp: torch (1, 3) vs mesh (0, 1)" in wrong
