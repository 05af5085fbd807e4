"""A run past its deadline: the verdict says in which phase the time ran out and how to give the run more."""

from __future__ import annotations

import pytest

from harness.battery import scenarios
from harness.battery.judge import checks
from harness.battery.launch import runner


@pytest.mark.parametrize(("recipe", "phase"), [
    pytest.param("first_window", "in window 0 of 3 (no window finished", marks=pytest.mark.slow),
    ("second_window", "in window 1 of 3 (window 0 finished)"),
])
def test_a_recipe_past_a_short_deadline_is_told_its_window_and_the_option(recipe: str, phase: str) -> None:
    """A recipe sleeping past deadline=3 s in window 0 (or 1) of varying: the verdict names it and --deadline."""
    run = runner.run_windows(f"user_recipes.slow:{recipe}", scenarios.build("varying", 2), deadline=3)
    verdict = checks.parity(run)
    assert ("fail", "deadline") == (verdict.status, verdict.cause), verdict.message
    assert f"the time ran out {phase}" in verdict.message
    assert verdict.message.endswith("raise it with --battery-deadline SECONDS (pytest and the command line alike); "
                                    "this run had 3 s")
