"""The battery under FSDP2 (``--strategy fsdp2``): the harness shards the model with ``fully_shard``, counts its
reduce-scatters, gathers full gradients, and judges a recipe with the same checks as under DDP. The controls of
FSDP2's own mistakes are in ``harness.recipes.controls.strategies`` (``test_negative_controls.py`` rejects each)."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks, registry
from harness.battery.judge.verdict import Verdict
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.recipes import CORRECT_RECIPE

SUMMED = "harness.recipes:summed_global_token_mean"


def _verdicts(recipe: str, strategy: str, scenario: str = "uneven", world: int = 2) -> dict[str, Verdict]:
    run = runner.run(RunSpec(recipe, scenario, world, "fp32", strategy=strategy))
    return {name: registry.CHECKS[name](run) for name in ("parity", "one_sync", "ranks_agree", "logged_loss")}


def test_the_correct_recipe_passes_under_fsdp2() -> None:
    """The same recipe, through ``sync_context``: one reduce-scatter pass per window, the reference's gradient."""
    verdicts = _verdicts(CORRECT_RECIPE, "fsdp2")
    assert all(v.status == "pass" for v in verdicts.values()), [v.message for v in verdicts.values()]
    assert "fsdp2" == verdicts["parity"].strategy


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_a_recipe_written_for_a_summing_reduction_passes_once_it_declares_it(strategy: str) -> None:
    """torchtitan's loss (the global count, no world-size factor) with ``reduction = "sum"``: the harness sums
    (DDP's hook; FSDP2's knobs on every sharded module). Without the declaration it is the control
    ``sum_loss_under_averaging``."""
    verdicts = _verdicts(SUMMED, strategy)
    assert all(v.status == "pass" for v in verdicts.values()), [v.message for v in verdicts.values()]


@pytest.mark.slow
def test_the_correct_recipe_passes_under_fsdp2_on_the_long_windows_at_three_ranks() -> None:
    """Four microbatches per window at W=3: still one synchronization, still the reference."""
    verdicts = _verdicts(CORRECT_RECIPE, "fsdp2", "long", 3)
    assert all(v.status == "pass" for v in verdicts.values()), [v.message for v in verdicts.values()]


@pytest.mark.slow
def test_the_divide_factor_on_the_root_only_is_named_in_the_verdict() -> None:
    """The failing parity names the setter and the modules it was not called on."""
    verdict = _verdicts("harness.recipes:divide_factor_on_root_only", "fsdp2")["parity"]
    assert ("fail", "numbers") == (verdict.status, verdict.cause)
    assert "set_gradient_divide_factor on the root (1.0) but not on" in verdict.message, verdict.message


@pytest.mark.slow
def test_a_model_with_an_unused_head_passes_under_fsdp2_in_bf16() -> None:
    """A head no forward reaches: FSDP2 shards the model as one group (a group never gathered cannot accumulate its
    gradients under a mixed-precision policy), says so, and the correct recipe passes."""
    run = runner.run(RunSpec(CORRECT_RECIPE, "uneven", 2, "bf16", strategy="fsdp2",
                             model="user_recipes.models:UnusedHead"))
    verdict = checks.parity(run)
    assert "pass" == verdict.status, verdict.message
    assert any("under FSDP2 the ranks shard the model as one group" in n for n in run.notes), run.notes
