"""A window without any supervised token has two correct policies: every rank raises ValueError, or every rank leaves
zero gradients (no NaN, no inf) and none hangs. Each way to get it wrong fails the empty_window check: a NaN
gradient, a raise on some ranks only, ranks that disagree on the backward, a hang (by the run's deadline). A NaN
logged loss beside zero gradients, as transformers' Trainer leaves, passes with a note naming what the loop must do."""

from __future__ import annotations

import dataclasses

import pytest

from harness.battery import scenarios
from harness.battery.judge import checks, registry
from harness.battery.judge.verdict import Verdict
from harness.battery.launch import runner
from harness.battery.launch.run import Run
from harness.battery.report.table import format_table

ZERO_POLICY = ("harness.recipes:skip_empty_window", "harness.recipes:zero_loss_on_empty_window")


def _empty(recipe: str, world: int = 2) -> Verdict:
    return checks.empty_window(runner.run(recipe, "all_empty", world))


def _with_records(run: Run, **change: object) -> Run:
    """``run`` with every rank's record of window 0 changed as ``change`` says (a value per rank, or one for all)."""
    assert run.records is not None
    records = []
    for rank, recs in enumerate(run.records):
        values = {k: v[rank] if isinstance(v, list) else v for k, v in change.items()}
        records.append([dataclasses.replace(recs[0], **values), *recs[1:]])
    return dataclasses.replace(run, records=records)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("recipe", ZERO_POLICY)
def test_a_recipe_that_skips_the_window_or_leaves_zero_gradients_on_every_rank_passes(recipe: str, world: int) -> None:
    """skip_empty_window (no backward, no gradient) and zero_loss_on_empty_window (a loss of 0, zero gradients) pass
    the empty window, saying which policy they took; the raising correct recipe passes too."""
    verdict = _empty(recipe, world)
    assert ("pass", ()) == (verdict.status, verdict.notes), verdict.message
    assert "the zero-gradient policy" in verdict.message
    assert "every rank raised ValueError" in _empty("harness.recipes:global_token_mean", world).message


# token_budget (the re-split's scenario) in the slow tier: the default tier's budget holds the older seven.
@pytest.mark.parametrize("scenario", [pytest.param(s, marks=pytest.mark.slow) if s == "token_budget" else s
                                      for s in scenarios.BATTERY_SCENARIOS])
def test_the_zero_gradient_recipes_pass_every_check_of_every_scenario(scenario: str) -> None:
    """Skipping the backward where every rank skips (the empty window) is legal: no other check fails it, and on a
    window empty on one rank only both recipes run the backward on every rank (a global count is not 0)."""
    for recipe in ZERO_POLICY:
        run = runner.run(recipe, scenario, 2)
        failing = [v.message for name, info in registry.REGISTRY.items() if info.runs_on(scenario)
                   for v in [info.fn(run)] if not v.passed]
        assert [] == failing


def test_a_nan_logged_loss_beside_zero_gradients_passes_with_a_note_naming_the_step_to_skip() -> None:
    """The Trainer's 0/0 loss: NaN returned, every gradient zero. A pass, with the note that the optimizer still
    steps unless the loop skips optimizer.step() when the window's global count is 0."""
    verdict = _empty("user_recipes.empty_policies:NanLossZeroGradients")
    assert "pass" == verdict.status, verdict.message
    (note,) = verdict.notes
    assert note.startswith("ranks 0, 1 logged nan beside zero gradients"), note
    assert ("momentum and weight decay move the weights (and the schedule advances) unless the loop skips "
            "optimizer.step() when the window's global count is 0") in note
    assert note in verdict.message


def test_the_battery_table_prints_the_nan_logged_loss_note_once_for_every_world_size() -> None:
    """The note is what the user must act on: the table says it once, with the cases it holds in."""
    verdicts = [_empty("user_recipes.empty_policies:NanLossZeroGradients", w) for w in (1, 2)]
    assert ["nan_logged_loss", "nan_logged_loss"] == [v.finding for v in verdicts]
    notes = [line for line in format_table(verdicts).splitlines() if line.startswith("  note: ")]
    assert 1 == len(notes), notes
    assert notes[0].startswith("  note: nan_loss_zero_gradients, empty_window (all_empty, W=1, fp32) and 1 more: "
                               "rank 0 logged nan beside zero gradients"), notes


def test_a_nan_gradient_on_an_empty_window_fails_naming_the_division_by_zero() -> None:
    """nan_on_empty_window divides its masked loss sum by a zero count: NaN in every gradient, no error raised."""
    verdict = _empty("harness.recipes:nan_on_empty_window")
    assert ("fail", "numbers") == (verdict.status, verdict.cause), verdict.message
    assert ("rank 0 returned None on a window without any supervised token, leaving NaN/inf in .grad: a training "
            "loop would step its optimizer on it (a loss sum divided by a zero count") in verdict.message
    assert verdict.fix is not None and "max(count, 1)" in verdict.fix


def test_a_raise_on_some_ranks_only_fails_and_the_same_recipe_passes_with_one_rank() -> None:
    """raise_on_rank_zero_only: rank 0 raises, rank 1 skips; at W=1 rank 0 is every rank, which is right."""
    verdict = _empty("harness.recipes:raise_on_rank_zero_only")
    assert ("fail", "numbers") == (verdict.status, verdict.cause), verdict.message
    assert ("rank 0 raised ValueError and rank 1 returned None on a window without any supervised token, leaving no "
            "gradient in .grad: the ranks took different decisions") in verdict.message
    assert _empty("harness.recipes:raise_on_rank_zero_only", 1).passed


def test_ranks_that_disagree_on_the_backward_of_an_empty_window_fail() -> None:
    """One rank ran the backward (one synchronization, zero gradients) while the other skipped it: their collectives
    no longer match, whatever the run survived."""
    good = runner.run("harness.recipes:skip_empty_window", "all_empty", 2)
    assert checks.empty_window(good).passed
    skewed = _with_records(good, syncs=[0, 1], grads_left=["none", "zero"])
    verdict = checks.empty_window(skewed)
    assert not verdict.passed
    assert "rank 1 synchronized gradients 1 time(s), other ranks 0" in verdict.message, verdict.message


@pytest.mark.parametrize(("change", "says"), [
    ({"grads_left": "nonzero", "logged": 2.5}, "returned 2.5 on a window without any supervised token, leaving "
                                               "nonzero gradients in .grad"),
    ({"grads_left": "nonfinite", "logged": float("nan")}, "leaving NaN/inf in .grad"),
    ({"weights_touched": 1e-3}, "changed weights by up to 1.000e-03 on a window without any supervised token"),
], ids=["nonzero", "nonfinite", "weights"])
def test_a_zero_gradient_recipe_that_leaves_anything_but_zeros_fails(change: dict[str, object], says: str) -> None:
    """The zero-gradient policy's own negative controls, on records: gradients of no token, NaN, an edited weight."""
    good = runner.run("harness.recipes:zero_loss_on_empty_window", "all_empty", 2)
    verdict = checks.empty_window(_with_records(good, **change))
    assert not verdict.passed and says in verdict.message, verdict.message


def test_a_recipe_that_hangs_on_an_empty_window_fails_by_its_deadline() -> None:
    """waits_for_tokens blocks every rank on the empty window: the run's deadline (3 s) ends it, and the verdict is
    the deadline's."""
    run = runner.run("user_recipes.empty_policies:WaitsForTokens", "all_empty", 2, deadline=3)
    verdict = checks.empty_window(run)
    assert ("fail", "deadline") == (verdict.status, verdict.cause), verdict.message


UNUSED_HEAD = "user_recipes.backward_models:NormWithUnusedHead"


def test_a_model_with_an_unused_head_meets_the_same_ddp_on_an_empty_window_as_on_every_other() -> None:
    """The reference has no backward on a window without any supervised token, so it cannot see the value head no
    forward reaches: the model probe's finding turns DDP's find_unused_parameters on there too, and a loop that runs
    every microbatch's forward and backward on that window (zero gradients, NaN loss) passes; with the option forced
    off the same run crashes on the second forward (the negative control: the setting is what decides)."""
    recipe = "user_recipes.empty_policies:NanLossSyncedEveryMicrobatch"
    kept = checks.empty_window(runner.run(recipe, "all_empty", 1, model=UNUSED_HEAD))
    assert "pass" == kept.status, kept.message
    off = checks.empty_window(runner.run(recipe, "all_empty", 1, model=UNUSED_HEAD, find_unused="off"))
    assert ("fail", "crash") == (off.status, off.cause), off.message
    assert "Expected to have finished reduction" in off.message + (off.details or "")
