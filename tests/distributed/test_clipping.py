"""Gradient clipping (a recipe whose ``backward_window`` takes ``max_norm``): the harness passes a ``max_norm`` that
makes clipping engage, clips the reference the way ``clip_grad_norm_`` does, and the clipping check holds the
returned norm to the reference's global norm. The controls (clip before the final sync, on one rank, by one shard's
norm under FSDP2) are in ``harness.recipes.controls.clipping``; ``test_negative_controls.py`` rejects each."""

from __future__ import annotations

import pytest

from harness.battery import checks, runner
from harness.battery.options import RunSpec
from harness.battery.scenarios import build

CLIPPED = "harness.recipes:clipped_global_token_mean"


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_the_correct_clipping_recipe_passes_parity_and_the_clipping_check(strategy: str) -> None:
    """The synchronized gradient, clipped over every parameter, is the clipped reference; the norm is global."""
    run = runner.run(RunSpec(CLIPPED, "uneven", 2, "fp32", strategy=strategy))
    assert run.max_norm is not None and run.reference_norms[0] is not None
    assert run.reference_norms[0] > run.max_norm  # clipping engaged: a max_norm above the norm would check nothing
    for name in ("parity", "clipping", "ranks_agree", "logged_loss"):
        verdict = checks.CHECKS[name](run)
        assert "pass" == verdict.status, verdict.message


def test_the_clipping_check_does_not_apply_to_a_recipe_that_does_not_clip() -> None:
    """The correct recipe has no max_norm: n/a, saying how a recipe opts in (decided before any rank starts)."""
    spec = RunSpec("harness.recipes:global_token_mean", "uneven", 2, "fp32")
    ready = runner.prepare(spec, build("uneven", 2))
    assert ready.chain.max_norm is None
    verdict = checks.clipping(ready.run(None))
    assert "n/a" == verdict.status and "max_norm keyword" in verdict.message


@pytest.mark.slow
def test_the_clip_before_the_final_sync_is_caught_by_its_norm() -> None:
    """The norm of one rank's partial gradient is not the window's global norm."""
    verdict = checks.clipping(runner.run(RunSpec("harness.recipes:clip_before_final_sync", "long", 2, "fp32")))
    assert ("fail", "numbers") == (verdict.status, verdict.cause)
    assert "the reference's global norm before clipping is" in verdict.message
