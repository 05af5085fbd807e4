"""The mesh scenarios hold the counts they are written for, per cp shard, under either chunking; a mesh without
their dimension is refused naming the scenario."""

from __future__ import annotations

import pytest

from harness.battery import mesh_scenarios
from harness.core.mesh import CHUNKINGS, Mesh
from harness.data.context_parallel import supervise_chunk

MESHES = ["dp=2,cp=2", "dp=1,cp=2", "dp=2,cp=4", "dp=3,cp=2"]


def shard_counts(name: str, mesh: Mesh, chunking: str) -> list[int]:
    """Each token rank's supervised count in the scenario's window (data rank, then cp shard)."""
    cp = mesh.size("cp")
    (window,) = mesh_scenarios.build(name, mesh, chunking)
    return [sum(supervise_chunk(mb, c, cp, chunking).supervised for mb in rank) for rank in window for c in range(cp)]


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("shape", MESHES)
def test_each_mesh_scenario_holds_its_counts(shape: str, chunking: str) -> None:
    mesh = Mesh.parse(shape)
    balanced = shard_counts("cp_balanced", mesh, chunking)
    assert 1 == len(set(balanced)) and balanced[0] > 0
    assert [0] * (mesh.token_ranks - 1) + [1] == shard_counts("one_token", mesh, chunking)
    empty = shard_counts("empty_shard", mesh, chunking)
    assert 0 == empty[mesh.size("cp") - 1] and all(n > 0 for i, n in enumerate(empty) if i != mesh.size("cp") - 1)


def test_the_base_scenario_gives_the_cp_shards_unequal_counts() -> None:
    """The negative control of cp_balanced's point: on uneven, a count over the wrong group is no common factor."""
    mesh = Mesh.parse("dp=2,cp=2")
    counts = shard_counts("uneven", mesh, "contiguous")
    assert counts[0] != counts[1] and counts[2] != counts[3]


def test_a_mesh_scenario_is_offered_where_its_dimension_is() -> None:
    assert ("cp_balanced", "one_token", "empty_shard") == mesh_scenarios.for_mesh(Mesh.parse("dp=2,cp=2"))
    assert ("one_token",) == mesh_scenarios.for_mesh(Mesh.parse("dp=2,tp=2"))
    assert () == mesh_scenarios.for_mesh(Mesh.parse("dp=4")) == mesh_scenarios.for_mesh(None)
    with pytest.raises(ValueError, match=r"scenario='empty_shard' needs a mesh with cp > 1 \(got dp=4\)"):
        mesh_scenarios.build("empty_shard", Mesh.parse("dp=4"))
