"""The layout's facts in the factor search (:mod:`harness.diagnosis.axes`): a scale equal to a mesh size and to the
microbatch count names both and the window that tells them apart, and every mesh and pipeline family of windows the
battery runs holds a case where each two facts a reading uses (k, M, A, each dimension's size, W) differ."""

from __future__ import annotations

import pytest

from harness.battery import mesh_scenarios
from harness.battery.scenarios import BATTERY_SCENARIOS, MULTI_RANK_ONLY
from harness.core.mesh import Mesh
from harness.diagnosis.axes import Axes, coincidences
from harness.diagnosis.factor_names import name_factor
from harness.diagnosis.fit import Block

READ = ("k", "M", "A", "W", "dp", "cp", "tp", "pp", "dp_replicate", "dp_shard")
"""The facts a reading uses: the microbatch count, the schedule's M and A, and each group's size."""

FAMILIES = {
    # The controls' meshes, and beside each the mesh that tells its two sizes apart (the one the reading names).
    "cp": (("dp=2,cp=2", "contiguous", 1, 1), ("dp=2,cp=2", "load_balanced", 1, 1), ("dp=3,cp=2", "contiguous", 1, 1)),
    "tp": (("dp=2,tp=2", "contiguous", 1, 1), ("dp=3,tp=2", "contiguous", 1, 1)),
    "hsdp": (("dp_replicate=2,dp_shard=2", "contiguous", 1, 1), ("dp_replicate=3,dp_shard=2", "contiguous", 1, 1)),
    # The pipeline controls' (M, A): the default (2, 1), M=4 in one step, A=2 steps of 2, and --pp-steps 3.
    "pp": tuple((mesh, "contiguous", m, a) for mesh in ("pp=2", "dp=2,pp=2", "dp=3,pp=2")
                for m, a in ((2, 1), (4, 1), (2, 2), (2, 3))),
}


def family_cases(family: str) -> list[dict[str, int]]:
    """Each window of each scenario the battery runs over each layout of ``family``, as its facts."""
    cases = []
    for label, chunking, m, a in FAMILIES[family]:
        mesh = Mesh.parse(label)
        names = [n for n in BATTERY_SCENARIOS if mesh.data_ranks > 1 or n not in MULTI_RANK_ONLY]
        for name in (*names, *mesh_scenarios.for_mesh(mesh)):
            for window in mesh_scenarios.build(name, mesh, chunking):
                pp = mesh.size("pp") > 1
                axes = Axes(mesh=mesh, k=len(window[0]), microbatches=m if pp else None, steps=a if pp else None)
                cases.append(axes.sizes())
    return cases


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_two_facts_a_reading_uses_differ_in_some_window_of_the_family(family: str) -> None:
    """No pair among k, M, A, W and each dimension's size holds one value in every window of a family."""
    assert [] == coincidences(family_cases(family), READ)


def test_a_family_where_k_always_equals_cp_is_caught() -> None:
    """Negative control: windows whose microbatch count is always cp's size fail the same check."""
    cases = [Axes(mesh=Mesh.parse(f"dp=2,cp={n}"), k=n).sizes() for n in (2, 3, 4)]
    assert [("cp", "k")] == coincidences(cases, READ)


def _blocks(token_ranks: int, k: int) -> list[Block]:
    return [Block(t, m, 10 + 3 * t + m) for t in range(token_ranks) for m in range(k)]


def test_a_factor_equal_to_k_and_cp_names_both_and_the_scenario_that_tells_them_apart() -> None:
    """At dp=2,cp=2 on a window of k=2, a scale of 1/2 reads as k, dp or cp, and names scenario long (k=5) and the
    mesh dp=3,cp=2 as the windows where they differ."""
    mesh = Mesh.parse("dp=2,cp=2")
    axes = Axes(mesh=mesh, k=2, elsewhere=mesh_scenarios.microbatch_counts(mesh))
    words = name_factor(0.5, _blocks(4, 2), 4, layout=axes)
    assert "k=2, dp=2 and cp=2 are equal in this window" in words, words
    assert "scenario long at mesh dp=2,cp=2, where k=5 (k from dp, k from cp)" in words, words
    assert "mesh dp=3,cp=2 (dp from cp)" in words, words


def test_a_factor_only_a_mesh_size_gives_is_named_by_it() -> None:
    """At dp=3,cp=2 with k=5, a scale of 1/2 is cp's size: read beside the catalog's fixed constant K=2, which
    alone named it before."""
    mesh = Mesh.parse("dp=3,cp=2")
    words = name_factor(0.5, _blocks(6, 5), 6, layout=Axes(mesh=mesh, k=5))
    assert "fixed accumulation constant K=2" in words and "every weight is 1/cp = 0.5 times the right one" in words, \
        words


def test_a_factor_equal_to_w_and_tp_names_the_mesh_that_tells_them_apart() -> None:
    """At dp=2,tp=2 with k=3, a scale of 1/3 is k alone, and one of 1/2 is W (dp's size) or tp's."""
    mesh = Mesh.parse("dp=2,tp=2")
    blocks = _blocks(2, 3)
    axes = Axes(mesh=mesh, k=3, elsewhere=mesh_scenarios.microbatch_counts(mesh))
    words = name_factor(1 / 3, blocks, 2, layout=axes)
    assert "k=3" in words and "tp" not in words, words
    words = name_factor(1 / 2, blocks, 2, layout=axes)
    assert "W=2 and tp=2 are equal in this window" in words and "mesh dp=3,tp=2 (W from tp)" in words, words


def test_without_a_layout_the_reading_is_the_counts_alone() -> None:
    """The search without a layout (a dp=W run read by the audit) names no mesh size."""
    words = name_factor(0.5, _blocks(4, 2), 4)
    assert "cp" not in words and "an extra division by the microbatch count k=2" in words, words
