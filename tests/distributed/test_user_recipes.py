"""Correct recipes written the way users write them (``tests/user_recipes/variants.py``) pass the battery: a verdict
must not depend on the recipe being shaped like the harness's own."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks
from harness.battery.launch import runner
from harness.battery.plan import cases as plan
from harness.battery.report.table import run_cases

# Each variant runs every float32 case at W=1 and 2 (about 20 launches): one in the fast tier, the rest in the slow
# tier that CI runs, so every shape is still judged on every push.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("attr", ["SkipsNoSyncOnOneProcess",
                                  *(pytest.param(a, marks=_SLOW) for a in ("ClassRecipe", "make_recipe",
                                                                             "CountsOnItsOwnGroup",
                                                                             "SetsItsThreadCount", "Float32Loss"))])
def test_a_correct_recipe_written_another_way_passes_every_float32_case(attr: str) -> None:
    """A class, a factory, no no_sync() on one process, setup() building a group, a changed thread count, and a
    float32 loss judged in the float32 lane: nothing fails at W = 1 and 2."""
    verdicts = run_cases(f"user_recipes.variants:{attr}", plan.cases([1, 2], "fp32"))
    assert [] == [v.message for v in verdicts if not v.passed]


def test_a_recipe_that_skips_no_sync_on_one_process_is_not_judged_on_syncs_there() -> None:
    """At W=1 there is nothing to synchronize: one_sync is n/a, not a failure (accelerate skips no_sync there)."""
    run = runner.run("user_recipes.variants:SkipsNoSyncOnOneProcess", "long", 1)
    assert "n/a" == checks.one_sync(run).status


def test_a_float32_loss_on_purpose_is_named_by_the_float64_lane() -> None:
    """The strict lane fails it, and says the error is float32 rounding (choose --precision fp32 to accept it)."""
    verdict = checks.parity(runner.run("user_recipes.variants:Float32Loss", "uneven", 2, "fp64"))
    assert "fail" == verdict.status and "float32_computation" == verdict.finding


def test_a_changed_thread_count_is_a_note_not_a_failure() -> None:
    """Hygiene passes and names the change."""
    verdict = checks.hygiene(runner.run("user_recipes.variants:SetsItsThreadCount", "uneven", 2))
    assert "pass" == verdict.status
    assert any("intra-op threads" in note for note in verdict.notes)
