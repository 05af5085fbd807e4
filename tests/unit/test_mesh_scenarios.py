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


def test_the_pipeline_scenarios_are_offered_on_a_mesh_with_pp_only() -> None:
    """``pp_uneven``, ``pp_balanced`` and ``pp_empty_step`` run where there is a pipeline; elsewhere the error names
    the dimension and a mesh that has it."""
    assert ("one_token", "pp_uneven", "pp_balanced", "pp_empty_step") == mesh_scenarios.for_mesh(
        Mesh.parse("dp=2,pp=2"))
    assert ("pp_uneven", "pp_balanced", "pp_empty_step") == mesh_scenarios.for_mesh(Mesh.parse("pp=2"))
    with pytest.raises(ValueError, match=r"scenario='pp_empty_step' needs a mesh with pp > 1 \(got dp=2\); give "
                                         r"--mesh, e.g. dp=2,pp=2"):
        mesh_scenarios.build("pp_empty_step", Mesh.parse("dp=2"))


def step_counts(name: str, shape: str, steps: int) -> list[list[int]]:
    """Each data rank's supervised count in each of ``steps`` schedule steps of the scenario's window."""
    from harness.distributed.pipeline import parts

    (window,) = mesh_scenarios.build(name, Mesh.parse(shape))
    return [[sum(mb.supervised for mb in part) for part in parts(rank, steps)] for rank in window]


@pytest.mark.parametrize("shape", ["pp=2", "dp=2,pp=2"])
def test_the_pipeline_windows_hold_the_counts_they_are_written_for(shape: str) -> None:
    """Every pipeline window holds 3 microbatches per data rank; at A = 2 and 3 ``pp_empty_step``'s first step holds
    no token on data rank 0 and, at A = 3, its last none on the last data rank, while no rank's window is empty;
    ``pp_balanced`` holds one count per data rank and step, ``pp_uneven`` different ones (its negative control)."""
    for name in ("pp_uneven", "pp_balanced", "pp_empty_step"):
        (window,) = mesh_scenarios.build(name, Mesh.parse(shape))
        assert {mesh_scenarios.PP_WINDOW} == {len(rank) for rank in window}
    for steps in (2, 3):
        empty = step_counts("pp_empty_step", shape, steps)
        assert 0 == empty[0][0] and all(sum(rank) > 0 for rank in empty)
        assert steps < 3 or 0 == empty[-1][-1]
    balanced = step_counts("pp_balanced", shape, 3)
    assert all(rank == balanced[0] for rank in balanced)
    uneven = step_counts("pp_uneven", shape, 3)
    assert len({n for rank in uneven for n in rank}) == sum(len(rank) for rank in uneven)
