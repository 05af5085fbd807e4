"""Gradient clipping (a recipe whose ``backward_window`` takes ``max_norm``): the harness passes a ``max_norm`` that
makes clipping engage, clips the reference the way ``clip_grad_norm_`` does, and the clipping check holds the
returned norm to the reference's global norm. The controls (clip before the final sync, on one rank, by one shard's
norm under FSDP2) are in ``harness.recipes.controls.clipping``; ``test_negative_controls.py`` rejects each."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks, registry
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.battery.prepare.steps import prepare
from harness.battery.scenarios import build

CLIPPED = "harness.recipes:clipped_global_token_mean"


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_the_correct_clipping_recipe_passes_parity_and_the_clipping_check(strategy: str) -> None:
    """The synchronized gradient, clipped over every parameter, is the clipped reference; the norm is global."""
    run = runner.run(RunSpec(CLIPPED, "uneven", 2, "fp32", strategy=strategy))
    assert run.max_norm is not None and run.reference_norms[0] is not None
    assert run.reference_norms[0] > run.max_norm  # clipping engaged: a max_norm above the norm would check nothing
    for name in ("parity", "clipping", "ranks_agree", "logged_loss"):
        verdict = registry.CHECKS[name](run)
        assert "pass" == verdict.status, verdict.message


def test_the_clipping_check_does_not_apply_to_a_recipe_that_does_not_clip() -> None:
    """The correct recipe has no max_norm: n/a, saying how a recipe opts in (decided before any rank starts)."""
    spec = RunSpec("harness.recipes:global_token_mean", "uneven", 2, "fp32")
    ready = prepare(spec, build("uneven", 2))
    assert ready.chain.max_norm is None
    verdict = checks.clipping(ready.run(None))
    assert "n/a" == verdict.status and "max_norm keyword" in verdict.message


@pytest.mark.slow
def test_the_clip_before_the_final_sync_is_caught_by_its_norm() -> None:
    """The norm of one rank's partial gradient is not the window's global norm: named as that rank's norm before the
    synchronization, with its ratio to the global one."""
    verdict = checks.clipping(runner.run(RunSpec("harness.recipes:clip_before_final_sync", "long", 2, "fp32")))
    assert ("fail", "numbers", "pre_sync_norm") == (verdict.status, verdict.cause, verdict.finding)
    assert "x the reference's global norm before clipping" in verdict.message


USER = "user_recipes.clipping"


def test_a_clip_that_never_engages_reads_clipping_not_applied_and_its_norm_a_sum_of_tensor_norms() -> None:
    """Each tensor clipped alone: the gradient is the unclipped reference (not "W applied twice", which its uniform
    scale 2.0 would read without the clipping reading), and the norm it returned, the sum of what each clip returned,
    is named with its ratio (about 3.3x) as a sum of per-tensor norms."""
    run = runner.run(RunSpec(f"{USER}:PerTensorClip", "uneven", 2, "fp32"))
    verdict = checks.parity(run)
    assert verdict.diagnosis is not None and "clipping_not_applied" == verdict.diagnosis["signature"]
    assert "clipping did not take effect (the gradient is the unclipped reference)" in verdict.message
    norm = checks.clipping(run)
    assert ("fail", "norm_sum_of_tensor_norms") == (norm.status, norm.finding)
    assert "x the reference's global norm before clipping" in norm.message
    assert "too small" not in norm.message and "pre-sync" not in norm.message


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "strategy", "finding", "words"), [
    (f"{USER}:NormReducedAgain", "ddp", "norm_reduced_again", "1.414x the reference's global norm"),
    (f"{USER}:ClipBeforeScale", "ddp", "clip_before_scale", "while it was still N/W = "),
    (f"{USER}:SumOfTensorNorms", "ddp", "norm_sum_of_tensor_norms", "a sum of per-tensor norms"),
    ("harness.recipes:clip_before_final_sync", "ddp", "pre_sync_norm", "rank 0's gradient before the synchronization"),
    ("harness.recipes:local_shard_norm", "fsdp2", "shard_norm", "the norm of rank 0's FSDP2 shard"),
], ids=["reduced_again", "before_scale", "sum_of_norms", "pre_sync", "shard"])
def test_each_wrong_norm_is_named_by_the_candidate_it_fits(recipe: str, strategy: str, finding: str,
                                                           words: str) -> None:
    """The clipping check's finding and sentence name the norm the recipe computed, with the ratio (W=2, uneven)."""
    verdict = checks.clipping(runner.run(RunSpec(recipe, "uneven", 2, "fp32", strategy=strategy)))
    assert ("fail", finding) == (verdict.status, verdict.finding), verdict.message
    assert words in verdict.message


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [f"{USER}:NormReducedAgain", f"{USER}:ClipBeforeScale"])
def test_a_gradient_clipped_by_a_wrong_norm_reads_clipped_by_wrong_norm(recipe: str) -> None:
    """The gradient is the reference clipped by the factor of the norm returned: named so, not as a count factor."""
    verdict = checks.parity(runner.run(RunSpec(recipe, "uneven", 2, "fp32")))
    assert verdict.diagnosis is not None and "clipped_by_wrong_norm" == verdict.diagnosis["signature"]


@pytest.mark.slow
def test_a_window_the_ranks_started_apart_is_read_on_the_last_window_they_started_together() -> None:
    """A clip on one rank leaves the ranks at different weights after window 0; window 1 (the worst on varying) is then
    no weighting at any one set of weights (unexplained before): its cause is read on window 0, and said so. The
    negative control: on uneven (one window) the same mistake reads on its own window, with no such words."""
    varying = checks.parity(runner.run("harness.recipes:clip_on_one_rank", "varying", 2))
    assert varying.diagnosis is not None and "clipping_not_applied" == varying.diagnosis["signature"], varying.message
    assert "the ranks started window 1 from different weights" in str(varying.diagnosis["sentence"])
    uneven = checks.parity(runner.run("harness.recipes:clip_on_one_rank", "uneven", 2))
    assert uneven.diagnosis is not None and "clipping_not_applied" == uneven.diagnosis["signature"], uneven.message
    assert "started window" not in str(uneven.diagnosis["sentence"])
