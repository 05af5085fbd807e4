"""The reduction contract (seed 001): the loss scale is derived from the comm hook's reduction. Under a summing hook
the world-size factor must go; the correct recipe for DDP's averaging fails there and a recipe derived for the sum
passes. The harness's one counting hook does both reductions (a DDP model takes a single comm hook)."""

from __future__ import annotations

import pytest
from support.reduction import loss_scale

from harness.battery.judge import checks
from harness.battery.judge.verdict import Verdict
from harness.battery.launch import runner
from harness.battery.scenarios import build
from harness.recipes import CORRECT_RECIPE as CORRECT

FOR_SUM = "support.reduction:summing_hook_token_mean"


@pytest.fixture(params=(2, pytest.param(3, marks=pytest.mark.slow)), ids=lambda w: f"world{w}")
def world_size(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def _parity(recipe: str, world_size: int, reduction: str) -> Verdict:
    return checks.parity(runner.run_windows(recipe, build("uneven", world_size), reduction=reduction))


def test_the_recipe_derived_for_a_summing_hook_passes_under_it(world_size: int) -> None:
    """``S_r / N`` per rank, summed by the hook, is the global token mean's gradient."""
    verdict = _parity(FOR_SUM, world_size, "sum")
    assert verdict.passed, verdict.message


def test_the_correct_averaging_recipe_fails_under_a_summing_hook(world_size: int) -> None:
    """Negative control: ``W * S_r / N`` summed (not averaged) is W times the intended gradient."""
    verdict = _parity(CORRECT, world_size, "sum")
    assert not verdict.passed
    assert "check parity FAILED" in verdict.message


def test_the_summing_hook_recipe_fails_under_ddp_s_default_averaging(world_size: int) -> None:
    """Negative control: the sum-derived scale under DDP's averaging is W times too small."""
    assert not _parity(FOR_SUM, world_size, "mean").passed


@pytest.mark.parametrize("reduction", ("mean", "sum"))
def test_at_world1_both_recipes_pass_under_either_hook(reduction: str) -> None:
    """With one rank, summing and averaging are the same reduction: why the W=1 lane cannot test this contract."""
    assert _parity(CORRECT, 1, reduction).passed
    assert _parity(FOR_SUM, 1, reduction).passed


@pytest.mark.parametrize(
    ("reduction", "world", "expected"), [("mean", 3, 3 / 6), ("sum", 3, 1 / 6), ("mean", 1, 1 / 6)],
    ids=["mean-world3", "sum-world3", "mean-world1"],
)
def test_the_loss_scale_follows_the_hook(reduction: str, world: int, expected: float) -> None:
    """Seed 001's three-rank exercise (N = 6): 3/6 under averaging, 1/6 under summing."""
    assert expected == loss_scale(reduction, 6, world)


def test_an_unknown_reduction_is_refused_with_its_name() -> None:
    """A reduction the hook does not implement is named in the error."""
    with pytest.raises(ValueError, match="reduction='max'"):
        loss_scale("max", 6, 2)
