"""The bf16 lane (``--precision bf16``): autocast under DDP, ``MixedPrecisionPolicy`` under FSDP2, judged against
float64 with a bound derived from the correct computation's measured noise (:mod:`harness.battery.bf16`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.battery import bf16, checks, runner
from harness.battery.options import RunSpec
from harness.battery.scenarios import build
from harness.recipes import CORRECT_RECIPE


def _parity(recipe: str, strategy: str = "ddp", scenario: str = "uneven") -> checks.Verdict:
    return checks.parity(runner.run(RunSpec(recipe, scenario, 2, "bf16", strategy=strategy)))


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_the_correct_recipe_stays_within_the_bound_derived_from_the_noise(strategy: str) -> None:
    """Its error is a fraction of the bound; the verdict prints the noise, the bound and the ratio."""
    verdict = _parity(CORRECT_RECIPE, strategy)
    assert "pass" == verdict.status, verdict.message
    assert verdict.worst_ratio is not None and verdict.worst_ratio < 1
    assert "the correct computation's own bf16 noise is" in verdict.message and "x the bound" in verdict.message


@pytest.mark.slow  # the default tier shows the lane on the correct recipe; its control runs here and in the table
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_mean_of_local_means_fails_in_bf16_and_is_diagnosed(strategy: str) -> None:
    """Negative control: the mistake stands many times the bound above the noise, and the diagnosis reads it
    from the bf16 gradient to the accuracy it states."""
    verdict = _parity("harness.recipes:mean_of_local_means", strategy)
    assert ("fail", "numbers") == (verdict.status, verdict.cause)
    assert verdict.diagnosis is not None and "mean_of_local_means" == verdict.diagnosis["signature"]
    assert "read from a bf16 gradient: weights to within" in verdict.message


@pytest.mark.slow
def test_a_window_too_balanced_for_a_mistake_to_show_is_not_judged() -> None:
    """Every rank holds the same microbatches: the mean of local means is the token mean, no bound can tell them
    apart, and the lane says so instead of passing."""
    window = build("uneven", 2)[0]
    balanced = [[window[1], window[1]]]
    run = runner.run_windows("harness.recipes:mean_of_local_means", balanced, "bf16", scenario="balanced")
    verdict = checks.parity(run)
    assert "n/a" == verdict.status, verdict.message
    assert "too balanced" in verdict.message and "no window of this case can be judged in bf16" in verdict.message


def test_the_bound_is_a_stated_multiple_of_the_measured_noise() -> None:
    """The bound is derived: NOISE_MULTIPLE times the largest error over the seeds, never a constant."""
    noise = bf16.Noise(0.004, (0.003, 0.004, 0.002), "autocast")
    assert bf16.NOISE_MULTIPLE * 0.004 == noise.bound
    assert "over 3 seeds" in noise.describe()


@pytest.mark.slow  # a pytest subprocess over both strategies and two lanes: about a minute
@pytest.mark.timeout(600)
def test_the_battery_passes_the_correct_recipe_under_both_strategies_in_fp32_and_bf16(tmp_path: Path) -> None:
    """``pytest -m recipe --strategy=both --precision=fp32,bf16`` from outside the checkout: every case passes (or
    does not apply), and the report holds verdicts of both strategies and both lanes."""
    report = tmp_path / "battery.json"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "harness.battery", "-m", "recipe", "-q", "-p", "no:cacheprovider",
         "--strategy=both", "--precision=fp32,bf16", "--battery-world-sizes=2", "--battery-examples=0",
         f"--battery-report={report}"], cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert 0 == done.returncode, done.stdout[-3000:]
    checks_run = json.loads(report.read_text())["checks"]
    assert {("ddp", "fp32"), ("ddp", "bf16"), ("fsdp2", "fp32"), ("fsdp2", "bf16")} == {
        (c["strategy"], c["precision"]) for c in checks_run}
    assert all(c["status"] != "fail" for c in checks_run)


@pytest.mark.slow
def test_a_clipping_recipe_is_judged_against_the_clipped_truth_in_bf16() -> None:
    """The float64 truth at the rank's weights is clipped the way the reference is before the recipe's clipped
    gradient is held to the bound (an unclipped truth would fail every clipping recipe by the clip factor)."""
    verdict = _parity("harness.recipes:clipped_global_token_mean")
    assert "pass" == verdict.status, verdict.message
