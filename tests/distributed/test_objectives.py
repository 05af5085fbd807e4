"""The declared objective on real ranks: each objective's correct recipe matches the reference of its own objective,
a recipe right for one objective fails under another and the diagnosis names the objective it computes, and the
policy-gradient recipes hold in their own normalization (``harness.recipes.objectives``). The objective controls
(a weighted mean over the count, a normalizer from the local batch, auxiliary terms in the wrong unit) are in the
catalog, shown rejected with the others in ``test_negative_controls.py``.

The default tier runs one representative case per objective; the whole matrix (every recipe, scenario, world size,
the hf batch format, the drawn layouts) is ``slow``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.battery import scenarios
from harness.battery.judge import checks, registry
from harness.battery.launch import runner
from harness.battery.launch.run import Run
from harness.battery.plan.options import BatteryOptions, RunSpec
from harness.recipes.objectives import OBJECTIVE_RECIPES

ROOT = Path(__file__).parents[2]
M = "harness.recipes.objectives"


def _run(recipe: str, objective: str, scenario: str = "uneven", world: int = 2, precision: str = "fp32",
         **fields: object) -> Run:
    return runner.run(RunSpec(recipe, scenario, world, precision, objective=objective, **fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(("recipe", "objective"), [
    (f"{M}:sequence_mean", "sequence_mean"),
    pytest.param(f"{M}:weighted_token_mean", "weighted_token_mean", marks=pytest.mark.slow),
    pytest.param(f"{M}:pg_fixed_normalizer", "fixed_normalizer", marks=pytest.mark.slow),
    pytest.param(f"{M}:token_mean_with_load_balance", "token_mean", marks=pytest.mark.slow),
], ids=["sequence_mean", "weighted_token_mean", "pg_fixed_normalizer", "load_balance"])
def test_each_objectives_correct_recipe_matches_the_reference_of_its_own_objective(recipe: str, objective: str) -> None:
    """Parity and the logged loss hold at W=2 on uneven ranks against the declared objective's reference."""
    run = _run(recipe, objective)
    for check in (checks.parity, checks.logged_loss):
        verdict = check(run)
        assert verdict.passed, verdict.message


def test_the_sequence_mean_recipe_judged_as_a_token_mean_is_named_the_sequence_mean() -> None:
    """The other half of token_mean_under_sequence_mean: a sequence mean fails the token mean, and the diagnosis says
    which objective it computes."""
    verdict = checks.parity(_run(f"{M}:sequence_mean", "token_mean"))
    assert "fail" == verdict.status and verdict.diagnosis is not None, verdict.message
    assert "sequence_mean" == verdict.diagnosis["objective_computed"], verdict.diagnosis["line"]
    assert "this gradient is the sequence mean" in str(verdict.diagnosis["line"])


OTHERS = {"token_mean": ("sequence_mean", "weighted_token_mean"), "sequence_mean": ("token_mean",),
          "weighted_token_mean": (), "fixed_normalizer": ("token_mean", "sequence_mean")}
"""The objectives each recipe is also judged under in the slow matrix. The weighted recipe is judged under its own
only: the harness draws weights for the weighted token mean alone, and with every weight 1 the weighted recipe is the
token mean (right under ``token_mean``). A recipe with advantages is not judged under the weighted token mean, which
refuses signed factors."""


MATRIX_SCENARIOS = ("uneven", "long", "one_empty")
"""The scenarios the objective matrix covers: the base one, four microbatches per window, a rank without tokens (the
objective's normalizer, its all-reduced quantity and an empty rank's share); the drawn-layout test below adds drawn
windows, and the objectives' controls run the battery's other scenarios."""


def _matrix() -> list[object]:
    out: list[object] = []
    for recipe, objective in OBJECTIVE_RECIPES.items():
        for scenario in scenarios.BATTERY_SCENARIOS:
            # Every scenario at W=3 (ranks of three length bands, a remainder in every count), and the base
            # scenario at W=1 and 2 too: the slow tier's budget, the default tier holding W=2's representatives.
            if scenario not in MATRIX_SCENARIOS:
                continue
            for world in (2, 3) if scenario == "uneven" else (3,):
                out.append(pytest.param(recipe, objective, scenario, world, marks=pytest.mark.slow,
                                        id=f"{recipe.split(':')[1]}-{scenario}-world{world}"))
    return out


@pytest.mark.parametrize(("recipe", "objective", "scenario", "world"), _matrix())
def test_every_objective_recipe_holds_on_every_scenario_under_its_objective(recipe: str, objective: str,
                                                                            scenario: str, world: int) -> None:
    """Every check of the battery, on the matrix's scenarios at W=3 (and the base one at W=1 and 2): the objective
    recipes are correct recipes."""
    run = _run(recipe, objective, scenario, world)
    for info in registry.REGISTRY.values():
        if info.runs_on(scenario):
            verdict = info.fn(run)
            assert verdict.passed, verdict.message


def _cross() -> list[object]:
    out: list[object] = []
    for recipe, own in OBJECTIVE_RECIPES.items():
        if "z_loss" in recipe or "load_balance" in recipe:
            continue
        for other in OTHERS[own]:
            if "pg_" in recipe and other == "weighted_token_mean":
                continue
            out.append(pytest.param(recipe, own, other, marks=pytest.mark.slow, id=f"{recipe.split(':')[1]}-{other}"))
    return out


@pytest.mark.parametrize(("recipe", "own", "other"), _cross())
def test_a_recipe_judged_under_another_objective_fails_and_is_named_by_its_own(recipe: str, own: str,
                                                                              other: str) -> None:
    """Right for its own objective, wrong for the others: parity fails, and the diagnosis names the objective the
    gradient is (a constant normalizer under the token or sequence mean reads as a scale, or as the constant itself
    where the recipe declares it)."""
    verdict = checks.parity(_run(recipe, other))
    assert "fail" == verdict.status and verdict.diagnosis is not None, verdict.message
    assert own == verdict.diagnosis["objective_computed"], verdict.diagnosis["line"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [f"{M}:weighted_token_mean", f"{M}:sequence_mean", f"{M}:token_mean_with_z_loss"])
def test_the_objective_recipes_hold_on_hugging_face_batches(recipe: str) -> None:
    """The hf dict carries the weights like its labels (position 0 is no target); parity holds under hf batches."""
    verdict = checks.parity(_run(recipe, OBJECTIVE_RECIPES[recipe], batch_format="hf"))
    assert verdict.passed, verdict.message


@pytest.mark.slow
def test_the_drawn_lane_draws_the_weights_and_rejects_a_weight_sum_taken_as_a_count() -> None:
    """Drawn layouts carry drawn weights (zeros included): the weighted recipe holds on every one, the count in place
    of the weight sum fails on a drawn layout, shrunk."""
    pytest.importorskip("hypothesis")
    from harness.battery.layouts import drawn_verdict

    options = BatteryOptions(examples=6, objective="weighted_token_mean", world_sizes=(1, 2, 3))
    good = drawn_verdict(f"{M}:weighted_token_mean", options, derandomize=True)
    assert "pass" == good.status, good.message
    bad = drawn_verdict("harness.recipes:weighted_by_count", options, derandomize=True)
    assert "fail" == bad.status and "factor_seed=" in bad.message, bad.message


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_pytest_with_objective_judges_the_sequence_mean_right_and_the_token_mean_wrong() -> None:
    """``pytest -m recipe --objective=sequence_mean --recipe=...``: the sequence-mean recipe passes parity, the
    token-mean recipe fails it, and its failure names the objective it computes."""
    select = ("-m", "recipe", "harness/battery/test_battery.py", "-k", "gradients_match and uneven-world2-fp32",
              "--objective=sequence_mean")
    good = _pytest(*select, f"--recipe={M}:sequence_mean")
    assert 0 == good.returncode, good.stdout[-2000:]
    bad = _pytest(*select, "--recipe=harness.recipes:global_token_mean")
    assert 1 == bad.returncode, bad.stdout[-2000:]
    assert "diagnosis (other_objective): this gradient is the token mean" in bad.stdout, bad.stdout[-2000:]
