"""torchtitan's own mixture-of-experts decoder through the battery (``harness.recipes.libraries.torchtitan_moe``): the
token mean holds on it at dp=W, torchtitan's bf16 grouped experts fail the float32 lane, and torchtitan's own expert
parallelism (DTensor experts ``Shard(0)`` over ep, the all-to-all dispatcher) holds over ``dp=2,ep=2`` under DDP and
``dp_shard=2,ep=2`` under FSDP2, where the experts averaged over the expert-data group read ``experts_scaled``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from harness.battery.judge import checks
from harness.battery.launch import runner
from harness.battery.launch.run import Run
from harness.battery.plan.options import RunSpec
from harness.core.mesh import Mesh
from harness.recipes.libraries._common import TORCHTITAN_HINT

# torchtitan's router asks CPU autocast for float32, which it refuses with a warning at every forward (the factory
# silences it in a battery run; pytest restores the filters around each test).
pytestmark = [pytest.mark.integrations, pytest.mark.filterwarnings("ignore:In CPU autocast")]

MODULE = "harness.recipes.libraries.torchtitan_moe"
MODEL = f"{MODULE}:torchtitan_moe"
MESH_RECIPE = "harness.recipes:mesh_token_mean"


@pytest.fixture(autouse=True)
def _torchtitan() -> None:
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip(TORCHTITAN_HINT)


def _mesh_run(recipe: str, mesh: str, strategy: str = "ddp", model: str = MODEL, scenario: str = "uneven") -> Run:
    layout = Mesh.parse(mesh)
    return runner.run(RunSpec(recipe, scenario, layout.world_size, "fp32", layout=layout, model=model,
                              strategy=strategy))


def _holds(run: Run) -> None:
    for check in (checks.parity, checks.one_sync, checks.ranks_agree, checks.logged_loss):
        verdict = check(run)
        assert verdict.passed, verdict.message


def test_the_factory_builds_torchtitans_moe_decoder_with_logits_per_position() -> None:
    """Logits [B, T, V] for model(inputs); the same weights from the same seed; the stacked experts and the router
    are where moe_plan says."""
    from harness.moe_plan import expert_parameters, router_parameters
    from harness.recipes.libraries import torchtitan_moe as tm

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        a = tm.torchtitan_moe()
        torch.manual_seed(7)
        b = tm.torchtitan_moe()
        inputs = torch.randint(1, 32, (3, 11))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert (3, 11, 32) == tuple(a(inputs).shape)
    experts = expert_parameters(a, tm.MOE_PLAN)
    assert ["layers.0.moe.routed_experts.inner_experts.w1_EFD", "layers.0.moe.routed_experts.inner_experts.w2_EDF",
            "layers.0.moe.routed_experts.inner_experts.w3_EFD"] == list(experts)
    assert (4, 64, 32) == tuple(experts["layers.0.moe.routed_experts.inner_experts.w1_EFD"].shape)
    assert ["layers.0.moe.router.gate.weight"] == list(router_parameters(a, tm.MOE_PLAN))


def test_the_token_mean_holds_on_torchtitans_moe_at_dp_w() -> None:
    """The correct recipe over dp=2 on torchtitan's MoE (the experts computing in float32)."""
    _holds(runner.run("harness.recipes:global_token_mean", "uneven", 2, "fp32", model=MODEL))


def test_torchtitans_own_expert_parallelism_holds_over_dp2_ep2_under_ddp() -> None:
    """torchtitan's RoutedExperts.parallelize and all-to-all dispatcher on gloo: each ep rank holds a Shard(0) of
    every stacked expert weight; the experts reduce over the expert-data group, the rest over the token group."""
    _holds(_mesh_run(MESH_RECIPE, "dp=2,ep=2"))


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "strategy", "model"), [
    ("dp_shard=2,ep=2", "fsdp2", MODEL),
    ("ep=2", "ddp", MODEL),
    ("dp=2,ep=2", "ddp", f"{MODULE}:torchtitan_moe_two_layers"),
], ids=["fsdp2-dp_shard2-ep2", "ddp-ep2", "ddp-dp2-ep2-two-layers"])
def test_torchtitans_own_expert_parallelism_holds_over_every_ep_layout(mesh: str, strategy: str, model: str) -> None:
    """Under FSDP2 the expert weights are 2-D DTensors (FSDP2's shard over the expert-data mesh on top of ep's)."""
    _holds(_mesh_run(MESH_RECIPE, mesh, strategy, model))


@pytest.mark.slow
@pytest.mark.parametrize(("control", "mesh", "strategy"), [
    ("experts_averaged_over_expert_data", "dp=2,ep=2", "ddp"),
    ("fsdp2_experts_averaged_over_their_mesh", "dp_shard=2,ep=2", "fsdp2"),
])
def test_experts_averaged_over_the_expert_data_group_read_experts_scaled_on_torchtitans_experts(
        control: str, mesh: str, strategy: str) -> None:
    """The controls that divide the experts' sum by the expert-data group's size (a recipe reducing them itself;
    FSDP2's expert module left averaging over its own mesh, torchtitan before PR #1551) fail on torchtitan's DTensor
    experts, 2 times too large at ep=2, and the diagnosis reads it."""
    verdict = checks.parity(_mesh_run(f"harness.recipes.controls.expert_parallel:{control}", mesh, strategy))
    assert not verdict.passed
    assert verdict.diagnosis is not None, verdict.message
    assert "experts_scaled" == verdict.diagnosis["signature"], verdict.diagnosis["line"]


@pytest.mark.slow
def test_torchtitans_bf16_grouped_experts_fail_the_float32_lane() -> None:
    """GroupedExperts as torchtitan ships it computes in bf16: an expert's gradient rounds differently when its
    tokens are split over three ranks than on one device (measured 3.0e-4 off)."""
    run = runner.run("harness.recipes:global_token_mean", "uneven", 3, "fp32",
                     model=f"{MODULE}:torchtitan_moe_bf16_experts")
    assert not checks.parity(run).passed
