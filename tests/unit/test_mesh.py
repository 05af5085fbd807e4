"""The layout of a run's ranks (``harness.core.mesh``): numbered as torch's DeviceMesh numbers them, its groups a
partition of the ranks, its data dimensions the ones that receive distinct windows."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.battery.plan.options import RunSpec
from harness.core.mesh import DATA_DIMS, DIMS, Mesh
from harness.testing.hypothesis_profiles import load_profile

load_profile()


@st.composite
def meshes(draw: st.DrawFn) -> Mesh:
    """A mesh of up to 4 dimensions and 24 ranks, dp alone or split in two."""
    split = draw(st.booleans())
    names = [n for n in DIMS if n != ("dp" if split else "dp_replicate") and n != ("dp" if split else "dp_shard")]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True))
    sizes = draw(st.lists(st.integers(1, 3), min_size=len(chosen), max_size=len(chosen)))
    return Mesh(tuple(zip(chosen, sizes)))


def torch_groups(mesh: Mesh, dims: tuple[str, ...]) -> set[tuple[int, ...]]:
    """The groups DeviceMesh forms over ``dims``: ``arange(W).view(shape)`` with ``dims`` moved last and flattened,
    one group per row (``mesh[dims]._flatten()``'s groups)."""
    inside = [i for i, n in enumerate(mesh.names) if n in dims]
    outside = [i for i in range(len(mesh.names)) if i not in inside]
    rows = torch.arange(mesh.world_size).view(*mesh.shape).permute(*outside, *inside).reshape(
        -1, math.prod(mesh.shape[i] for i in inside))
    return {tuple(sorted(int(r) for r in row)) for row in rows}


def groups_match_torch(mesh: Mesh) -> list[str]:
    """Each dimension set whose groups differ from DeviceMesh's (empty: the numbering is torch's)."""
    out = []
    for dims in ((n,) for n in mesh.names):
        if set(mesh.groups(dims)) != torch_groups(mesh, dims):
            out.append(",".join(dims))
    if set(mesh.groups(mesh.token_dims)) != torch_groups(mesh, mesh.token_dims):
        out.append("token dims")
    return out


@given(meshes())
def test_groups_are_the_groups_device_mesh_forms(mesh: Mesh) -> None:
    """Over every dimension, and over the dimensions a count is reduced over, the groups are DeviceMesh's."""
    assert [] == groups_match_torch(mesh)


def test_the_torch_comparison_rejects_a_column_major_numbering() -> None:
    """Its negative control: a mesh whose first dimension runs fastest forms other dp and cp groups."""

    class ColumnMajor(Mesh):
        def coords(self, rank: int) -> dict[str, int]:
            out = {}
            for name, size in self.dims:
                rank, out[name] = divmod(rank, size)
            return out

    assert ["dp", "cp"] == groups_match_torch(ColumnMajor((("dp", 2), ("cp", 2))))
    assert [] == groups_match_torch(Mesh((("dp", 2), ("cp", 2))))


@given(meshes(), st.data())
def test_groups_partition_the_ranks(mesh: Mesh, data: st.DataObject) -> None:
    """Every set of dimensions forms groups that cover each rank exactly once, of the dimensions' product in size."""
    dims = data.draw(st.lists(st.sampled_from(mesh.names), unique=True))
    groups = mesh.groups(dims)
    assert sorted(r for g in groups for r in g) == list(range(mesh.world_size))
    size = 1
    for d in dims:
        size *= mesh.size(d)
    assert {size} == {len(g) for g in groups}


@given(meshes())
def test_a_rank_reads_its_coordinates_back(mesh: Mesh) -> None:
    """``rank_at(coords(r)) == r`` for every rank."""
    assert list(range(mesh.world_size)) == [mesh.rank_at(mesh.coords(r)) for r in range(mesh.world_size)]


@given(meshes())
def test_ranks_share_a_window_exactly_when_they_share_a_data_coordinate(mesh: Mesh) -> None:
    """``data_rank`` takes each of ``data_ranks`` values, and two ranks get the same one exactly when they differ
    outside the data dimensions only."""
    assert set(range(mesh.data_ranks)) == {mesh.data_rank(r) for r in range(mesh.world_size)}
    non_data = [n for n in mesh.names if n not in DATA_DIMS]
    for group in mesh.groups(non_data):
        assert 1 == len({mesh.data_rank(r) for r in group})


@given(meshes())
def test_ranks_share_tokens_exactly_when_they_differ_on_tp_or_pp_only(mesh: Mesh) -> None:
    """``token_rank`` takes each of ``token_ranks`` values; two ranks share one exactly when they differ outside the
    token dimensions only; ``holder`` is the first rank of each (its token rank read back)."""
    assert set(range(mesh.token_ranks)) == {mesh.token_rank(r) for r in range(mesh.world_size)}
    for group in mesh.groups([n for n in mesh.names if n not in mesh.token_dims]):
        assert 1 == len({mesh.token_rank(r) for r in group})
    for t in range(mesh.token_ranks):
        holder = mesh.holder(t)
        assert t == mesh.token_rank(holder)
        assert holder == min(r for r in range(mesh.world_size) if mesh.token_rank(r) == t)


def test_the_default_layout_is_every_rank_its_own_data() -> None:
    """``dp=W``: W windows, rank r trains on the r-th, and a count spans the world."""
    mesh = Mesh.data_parallel(4)
    assert (4, 4, "dp=4") == (mesh.world_size, mesh.data_ranks, mesh.label)
    assert [0, 1, 2, 3] == [mesh.data_rank(r) for r in range(4)]
    assert (0, 1, 2, 3) == mesh.group(2, mesh.token_dims)


def test_a_cp_by_tp_mesh_counts_over_dp_and_cp_but_not_tp() -> None:
    """At dp=2,cp=2,tp=2 rank 5 (dp 1, cp 0, tp 1) counts with ranks 1, 3, 5, 7 and shares its window with 4-7."""
    mesh = Mesh.parse("tp=2,dp=2,cp=2")
    assert "dp=2,cp=2,tp=2" == mesh.label
    assert {"dp": 1, "cp": 0, "tp": 1} == mesh.coords(5)
    assert (1, 3, 5, 7) == mesh.group(5, mesh.token_dims)
    assert [1, 1, 1, 1] == [mesh.data_rank(r) for r in (4, 5, 6, 7)]


@pytest.mark.parametrize(("text", "says"), [
    ("dp=2,xp=2", "'xp' is not one of"),
    ("dp=2,dp=2", "names a dimension twice"),
    ("dp=2,dp_shard=2", "mixes dp with dp_replicate/dp_shard"),
    ("dp=0", "dp=0 must be a positive number"),
    ("dp2", "is not NAME=SIZE"),
    ("dp=two", "is not NAME=SIZE"),
])
def test_a_bad_mesh_is_refused_naming_the_argument_and_the_fix(text: str, says: str) -> None:
    """Each mistake is a ValueError naming ``--mesh``, the value and what is wrong."""
    with pytest.raises(ValueError, match=f"--mesh={text!r}") as info:
        Mesh.parse(text)
    assert says in str(info.value)


@pytest.mark.parametrize(("fields", "says"), [
    ({"world_size": 2, "layout": Mesh.parse("dp=2,cp=2")}, "layout=dp=2,cp=2 has 4 ranks but world_size=2"),
    ({"world_size": 4, "layout": Mesh.parse("pp=2,tp=2")}, "tp with pp is not run yet"),
    ({"world_size": 4, "layout": Mesh.parse("dp=2,tp=2")}, "strategy='ddp' over the mesh dp=2,tp=2"),
    ({"world_size": 4, "layout": "dp=2,cp=2"}, "must be a harness.core.mesh.Mesh"),
    ({"world_size": 4, "layout": Mesh.parse("dp=2,cp=2"), "chunking": "striped"}, "chunking='striped' must be one of"),
])
def test_a_run_over_a_mesh_it_cannot_run_is_refused_naming_the_field(fields: dict[str, object], says: str) -> None:
    """RunSpec refuses a layout of another world size, a dimension the battery does not run yet, tp under DDP, a
    layout given as text and an unknown chunking, each naming the field."""
    with pytest.raises(ValueError, match=re.escape(says)):
        RunSpec("harness.recipes:global_token_mean", "uneven", **fields)  # type: ignore[arg-type]


def test_fsdp2_stages_of_a_pipeline_over_dp_are_accepted() -> None:
    """FSDP2 wraps a pipeline's stages over dp as DDP does: the spec keeps the strategy and the mesh."""
    spec = RunSpec("harness.recipes:pipeline_token_mean", "uneven", 4, layout=Mesh.parse("dp=2,pp=2"),
                   strategy="fsdp2")
    assert ("fsdp2", 2, 2) == (spec.strategy, spec.mesh.size("dp"), spec.mesh.size("pp"))


def test_a_run_without_a_layout_is_data_parallel_over_its_world() -> None:
    """``RunSpec.mesh`` is ``dp=W`` unless a layout is given."""
    assert "dp=3" == RunSpec("harness.recipes:global_token_mean", "uneven", 3).mesh.label
    assert "dp=2,cp=2" == RunSpec("harness.recipes:global_token_mean", "uneven", 4,
                                  layout=Mesh.parse("cp=2,dp=2")).mesh.label


def test_mesh_options_give_the_cases_their_shapes() -> None:
    """``--mesh dp=2,cp=2 --mesh cp=2``: every case runs at one of the shapes (W=4 and W=2), its id names the mesh,
    and one_empty (a data coordinate without tokens) is left out where the mesh has a single data coordinate."""
    from harness.battery.plan import cases as plan
    from harness.battery.plan.options import BatteryOptions

    options = BatteryOptions.parse(mesh=["dp=2,cp=2", "cp=2"], precision="fp32")
    cases = plan.session_cases(options, checks=["parity"])
    assert {("dp=2,cp=2", 4), ("cp=2", 2)} == {(c.mesh.label, c.world_size) for c in cases if c.mesh}
    assert all(c.mesh is not None for c in cases)
    assert "uneven-world4-fp32-dp2xcp2" in {c.id for c in cases}
    assert ("one_empty", "cp=2") not in {(c.scenario, c.mesh.label) for c in cases if c.mesh}
    assert ("one_empty", "dp=2,cp=2") in {(c.scenario, c.mesh.label) for c in cases if c.mesh}


@pytest.mark.parametrize(("value", "says"), [
    ("pp=2,dp_replicate=2", "--mesh=pp=2,dp_replicate=2: a pipeline (pp > 1) runs beside dp only for now"),
    ("dp=2,tp=2", "--strategy='ddp' over the mesh dp=2,tp=2: DDP cannot wrap"),
    ("dp=4,cp=4", "--mesh='dp=4,cp=4' has 16 ranks: at most 8 run in one process"),
    ("dp=2 cp", "--mesh='cp': 'cp' is not NAME=SIZE"),
])
def test_a_mesh_option_the_battery_cannot_run_is_refused_naming_it(value: str, says: str) -> None:
    """Each refusal names ``--mesh``, the shape and why."""
    from harness.battery.plan.options import BatteryOptions

    with pytest.raises(ValueError, match=re.escape(says)):
        BatteryOptions.parse(mesh=value)


def test_torchrun_takes_a_mesh_larger_than_one_process_launches() -> None:
    """Under torchrun (``max_world_size=None``) ``dp=2,cp=8`` (16 ranks, two nodes of 8) is a mesh; the scenarios'
    limit on data-parallel ranks still holds, naming it."""
    from harness.battery.plan.options import parse_meshes

    (mesh,) = parse_meshes("dp=2,cp=8", max_world_size=None)
    assert (16, 2) == (mesh.world_size, mesh.data_ranks)
    with pytest.raises(ValueError, match=re.escape("--mesh='dp=64' has 64 data-parallel ranks: the scenarios are "
                                                   "built for at most 32")):
        parse_meshes("dp=64", max_world_size=None)
