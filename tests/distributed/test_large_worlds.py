"""The battery past four ranks: the in-process launcher takes up to eight on CPU, and the scenarios are built for any
world size up to 32 (torchrun jobs), each rank in its own length band. Slow tier: eight ranks on two cores take
seconds per run."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks
from harness.battery.launch import runner

pytestmark = pytest.mark.slow


def test_the_correct_recipe_passes_and_a_factor_written_for_two_ranks_fails_at_eight() -> None:
    good = runner.run("harness.recipes:global_token_mean", "uneven", 8)
    assert checks.parity(good).passed and checks.one_sync(good).passed
    bad = checks.parity(runner.run("harness.recipes:hard_coded_world_size", "uneven", 8))
    assert not bad.passed and bad.diagnosis is not None
    assert "written for W=2" in str(bad.diagnosis["line"]), bad.diagnosis["line"]


def test_a_rank_without_tokens_among_eight_keeps_the_global_token_mean() -> None:
    run = runner.run("harness.recipes:global_token_mean", "one_empty", 8)
    assert checks.parity(run).passed, checks.parity(run).message
