"""An auxiliary term on a device mesh: the reference adds each microbatch's auxiliary value once per data coordinate
(not once per cp rank), the mesh recipes scale each term for its own unit's group, and the term scaled for the token
group where the data-parallel one belongs (Megatron-LM #5047) fails parity over dp x cp, read as cp's size."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.core.mesh import Mesh

M = "harness.recipes.objectives"
LOAD_BALANCE = f"{M}:mesh_token_mean_with_load_balance"
Z_LOSS = f"{M}:mesh_token_mean_with_z_loss"
CONTROL = "harness.recipes:aux_scaled_for_token_group"


def mesh_run(recipe: str, shape: str = "dp=2,cp=2", scenario: str = "uneven") -> runner.Run:
    mesh = Mesh.parse(shape)
    return runner.run(RunSpec(recipe, scenario, mesh.world_size, "fp32", layout=mesh))


def test_the_router_loss_scaled_for_the_token_group_fails_where_the_mesh_recipe_passes() -> None:
    """At dp=2,cp=2 the load-balancing term scaled by dp x cp over the microbatch count weighs cp times its right
    weight, and the diagnosis names cp's size; the same term scaled by dp's size passes parity and the logged loss."""
    verdict = checks.parity(mesh_run(CONTROL))
    assert "fail" == verdict.status and "numbers" == verdict.cause, verdict.message
    assert verdict.diagnosis is not None
    assert "auxiliary_misweighted" == verdict.diagnosis["signature"], verdict.diagnosis["line"]
    assert "cp's size (2) times the right weight" in str(verdict.diagnosis["line"]), verdict.diagnosis["line"]
    good = mesh_run(LOAD_BALANCE)
    for check in (checks.parity, checks.logged_loss, checks.one_sync):
        assert check(good).passed, check(good).message


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [LOAD_BALANCE, CONTROL])
@pytest.mark.parametrize("shape", ["dp=2", "dp=3"])
def test_without_cp_the_token_group_is_the_data_parallel_one_and_both_scalings_pass(recipe: str, shape: str) -> None:
    """On dp=W the two groups are one: the mesh recipe and the control both pass (every cp mistake vanishes at
    cp=1)."""
    verdict = checks.parity(mesh_run(recipe, shape))
    assert verdict.passed, verdict.message


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [Z_LOSS, f"{M}:token_mean_with_load_balance", f"{M}:token_mean_with_z_loss"])
def test_the_other_auxiliary_recipes_hold_over_dp_and_cp(recipe: str) -> None:
    """The z-loss (its unit the token, so its group the main loss's) on a mesh, and the data-parallel recipes, whose
    world is the token group when the mesh has no tp: every check that judges the gradient and the logged loss."""
    run = mesh_run(recipe)
    for check in (checks.parity, checks.logged_loss, checks.one_sync, checks.ranks_agree):
        verdict = check(run)
        assert verdict.passed, verdict.message


@pytest.mark.slow
@pytest.mark.parametrize(("control", "signature", "words"), [
    ("auxiliary_token_normalized", "auxiliary_token_normalized", "W/N = 4/"),
    ("auxiliary_summed_over_ranks", "auxiliary_summed_over_ranks", "the token group's size T=4"),
    ("auxiliary_divided_twice", "auxiliary_divided_twice", "k=2 twice"),
])
def test_the_auxiliary_readings_name_their_mistakes_over_dp_and_cp(control: str, signature: str, words: str) -> None:
    """The objectives family's auxiliary controls at dp=2,cp=2: each microbatch's term is held by its cp ranks alike,
    and each reading still names its own mistake, its factors counted over the token group."""
    verdict = checks.parity(mesh_run(f"harness.recipes:{control}"))
    assert "fail" == verdict.status and verdict.diagnosis is not None, verdict.message
    assert signature == verdict.diagnosis["signature"], verdict.diagnosis["line"]
    assert words in str(verdict.diagnosis["line"]), verdict.diagnosis["line"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [LOAD_BALANCE, Z_LOSS])
def test_the_mesh_auxiliary_recipes_hold_over_dp_and_tp(recipe: str) -> None:
    """At dp=2,tp=2 under FSDP2 the tp ranks hold their coordinate's microbatches again and are in neither group: the
    count over the token group and the microbatch count over the data-parallel group give each term once."""
    run = runner.run(RunSpec(recipe, "uneven", 4, "fp32", strategy="fsdp2", layout=Mesh.parse("dp=2,tp=2")))
    for check in (checks.parity, checks.logged_loss):
        verdict = check(run)
        assert verdict.passed, verdict.message
