"""Mistakes that only a broken symmetry shows, each failing the battery's scenarios now that those break it: a sequence
mean over a rank's own rows (ranks hold different numbers of supervised rows), a per-microbatch sequence mean over
k (microbatches hold different numbers of rows), and a count all-reduced as float16 (a window count over 2048 that
float16 must round) at ``--battery-world-sizes 2``, ``4`` and ``2,4``. The scenario-side test with its control is
``tests/unit/test_scenarios.py``; a count rounded to bfloat16 is the bf16 lane's
(``tests/distributed/test_bf16.py``)."""

from __future__ import annotations

import pytest

from harness.battery import scenarios
from harness.battery.judge import checks
from harness.battery.judge.verdict import Verdict
from harness.battery.launch import runner
from harness.battery.plan.options import BatteryOptions, RunSpec
from harness.battery.report.table import run_controls


def _parity(recipe: str, scenario: str, world: int, objective: str = "token_mean") -> Verdict:
    return checks.parity(runner.run(RunSpec(recipe, scenario, world, "fp32", objective=objective)))


def test_a_sequence_mean_over_a_ranks_own_rows_fails_the_base_window() -> None:
    """On ``uneven`` at W=2 the ranks hold 7 and 5 supervised rows: each rank's own sequence mean, averaged by DDP,
    misses the global one, and the diagnosis reads a mean of local means. Its control, the correct sequence mean
    on the same window, passes."""
    verdict = _parity("harness.recipes:local_sequence_count", "uneven", 2, "sequence_mean")
    assert ("fail", "numbers") == (verdict.status, verdict.cause), verdict.message
    assert verdict.diagnosis is not None and "mean_of_local_means" == verdict.diagnosis["signature"]
    assert _parity("harness.recipes.objectives:sequence_mean", "uneven", 2, "sequence_mean").passed


@pytest.mark.slow  # six launches
def test_a_sequence_mean_over_a_ranks_own_rows_fails_at_least_four_scenarios() -> None:
    """Every battery scenario with tokens gives its ranks different numbers of supervised rows, so the mistake fails
    parity in at least 4 of them at W=2 (before, only ``sparse`` and ``one_empty`` held unequal rows)."""
    failed = [name for name in scenarios.BATTERY_SCENARIOS if name != "all_empty"
              if not _parity("harness.recipes:local_sequence_count", name, 2, "sequence_mean").passed]
    assert len(failed) >= 4, failed


def test_a_per_microbatch_sequence_mean_fails_on_one_rank() -> None:
    """At W=1 no rank imbalance can show it: each microbatch's own sequence mean over k is wrong only because the
    rank's microbatches hold different numbers of rows (4 and 3 on ``uneven``). Its control, the correct sequence
    mean, passes there."""
    verdict = _parity("harness.recipes:per_microbatch_sequence_mean", "uneven", 1, "sequence_mean")
    assert ("fail", "numbers") == (verdict.status, verdict.cause), verdict.message
    assert _parity("harness.recipes.objectives:sequence_mean", "uneven", 1, "sequence_mean").passed


@pytest.mark.slow  # W=2 runs in the default tier with every control; this adds W=4
def test_a_count_all_reduced_as_float16_fails_at_world_sizes_2_and_4() -> None:
    """``--battery-world-sizes 2,4`` (and so 2 and 4 alone): the ``long`` window holds an odd count over 2048 at each
    world size, float16 rounds the all-reduced sum, and parity rejects the 0.04% scale."""
    results = run_controls(["float16_count"], BatteryOptions(world_sizes=(2, 4)))
    assert [2, 4] == [r.verdict.world_size for r in results]
    assert all(r.rejected for r in results), [r.verdict.message for r in results]
