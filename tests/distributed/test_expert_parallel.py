"""Expert parallelism (``--mesh dp=2,ep=2``): the built-in MoE model's experts spread over ep, dense parameters
reduced over the token group, expert parameters over the expert-data group divided by the token group's size, under
DDP and FSDP2; a recipe that owns the expert reduction and gets it wrong is caught."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks
from harness.battery.launch import runner
from harness.battery.launch.run import Run
from harness.battery.plan.options import RunSpec
from harness.core.mesh import Mesh

MOE = "harness.moe:moe"
CORRECT = "harness.recipes:mesh_token_mean"


def _run(recipe: str, mesh: str, scenario: str = "uneven", strategy: str = "ddp", precision: str = "fp32") -> Run:
    layout = Mesh.parse(mesh)
    return runner.run(RunSpec(recipe, scenario, layout.world_size, precision, layout=layout, model=MOE,
                              strategy=strategy))


def test_the_correct_recipe_holds_parity_over_dp2_ep2_under_ddp() -> None:
    """The representative case: 4 ranks, each computing 2 of the 4 experts; parity, one synchronization and
    agreeing ranks hold."""
    run = _run(CORRECT, "dp=2,ep=2")
    for check in (checks.parity, checks.one_sync, checks.ranks_agree):
        verdict = check(run)
        assert verdict.passed, verdict.message


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "strategy"), [("dp=2,ep=2", "fsdp2"), ("dp_shard=2,ep=2", "fsdp2"),
                                                ("ep=2", "ddp"), ("dp=2,ep=2", "ddp")])
@pytest.mark.parametrize("scenario", ["one_empty", "single"])
def test_the_correct_recipe_holds_over_every_ep_layout(mesh: str, strategy: str, scenario: str) -> None:
    run = _run(CORRECT, mesh, scenario, strategy)
    for check in (checks.parity, checks.one_sync, checks.ranks_agree, checks.logged_loss):
        verdict = check(run)
        assert verdict.passed, verdict.message


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "mesh", "strategy"), [
    ("harness.recipes:mesh_token_mean_reducing_experts", "dp=2,ep=2", "ddp"),
    ("harness.recipes:mesh_token_mean_reducing_experts", "ep=2", "ddp"),
    ("harness.recipes:mesh_token_mean_with_router_balance", "dp=2,ep=2", "ddp"),
    ("harness.recipes:mesh_token_mean_with_router_balance", "dp_shard=2,ep=2", "fsdp2"),
])
def test_the_correct_counterparts_of_the_expert_controls_hold(recipe: str, mesh: str, strategy: str) -> None:
    """The recipe that reduces the experts itself (dividing by the token group's size) and the router's
    load-balancing term beside the token mean hold where their controls fail."""
    run = _run(recipe, mesh, "uneven", strategy)
    for check in (checks.parity, checks.one_sync, checks.ranks_agree):
        verdict = check(run)
        assert verdict.passed, verdict.message


@pytest.mark.slow
@pytest.mark.parametrize(("control", "reading", "factor"), [
    ("experts_averaged_over_expert_data", "experts_scaled", 2.0),
    ("experts_never_divided_at_full_ep", "experts_scaled", 2.0),
    ("fsdp2_experts_averaged_over_their_mesh", "experts_scaled", 2.0),
    ("router_gates_without_grad", "router_cut_off", None),
])
def test_each_expert_control_fails_parity_with_its_group_named(control: str, reading: str,
                                                               factor: float | None) -> None:
    from harness.recipes import CONTROLS

    target = CONTROLS[control]
    verdict = checks.parity(_run(f"harness.recipes:{control}", str(target.mesh), target.scenario, target.strategy))
    assert "fail" == verdict.status and "numbers" == verdict.cause, verdict.message
    assert verdict.diagnosis is not None and reading == verdict.diagnosis["signature"], verdict.message
    if factor is not None:
        assert "ep=2" in verdict.diagnosis["line"]


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "strategy"), [("dp=2,ep=2", "ddp"), ("dp_shard=2,ep=2", "fsdp2")])
def test_a_users_own_moe_model_runs_over_ep_through_its_declarations(mesh: str, strategy: str) -> None:
    """``user_recipes.moe_models:my_moe`` declares only ``moe_plan`` and ``ep_plan``: the correct recipe holds, and
    the experts averaged over the expert-data group read ``experts_scaled`` on it too."""
    layout = Mesh.parse(mesh)
    model = "user_recipes.moe_models:my_moe"
    run = runner.run(RunSpec(CORRECT, "uneven", 4, "fp32", layout=layout, model=model, strategy=strategy))
    for check in (checks.parity, checks.one_sync, checks.ranks_agree):
        verdict = check(run)
        assert verdict.passed, verdict.message
    if strategy == "ddp":
        wrong = checks.parity(runner.run(RunSpec("harness.recipes:experts_averaged_over_expert_data", "uneven", 4,
                                                 "fp32", layout=layout, model=model)))
        assert wrong.diagnosis is not None and "experts_scaled" == wrong.diagnosis["signature"], wrong.message


@pytest.mark.slow
def test_a_forward_without_gradients_between_a_forward_and_its_backward_leaves_the_expert_reduction_armed() -> None:
    """A correct loop that evaluates (no grad) between forward and backward holds parity over dp=2,ep=2 under DDP:
    the forward without gradients decides nothing (it once disarmed the experts' reduction, and the experts read
    as never reduced over dp)."""
    verdict = checks.parity(_run("user_recipes.moe_models:EvalBetweenForwardAndBackward", "dp=2,ep=2"))
    assert verdict.passed, verdict.message
