"""Every battery check is shown to reject a wrong recipe, and the fixtures are shown to be the reason it can.

Each control in ``harness.recipes`` reproduces a real mistake; here it runs through the same checks as the recipe under
test and must fail them. The "passes" tests document what the seeds warn about: a wrong recipe that looks right on
the easy fixtures.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.battery import checks, runner

ROOT = Path(__file__).parents[2]


def control(name: str) -> str:
    return f"harness.recipes:{name}"


@pytest.mark.parametrize("world_size", (2, 3), ids=lambda w: f"world{w}")
def test_the_mean_of_local_means_fails_parity_on_uneven_ranks(world_size: int) -> None:
    """Seed 000's wrong=True: ranks with different token counts expose the mean-of-means bias."""
    verdict = checks.parity(runner.run(control("mean_of_local_means"), "uneven", world_size))
    assert not verdict.passed
    assert "check parity FAILED" in verdict.message


def test_the_mean_of_local_means_misses_by_at_least_100_tolerances_at_world2() -> None:
    """On the default uneven fixture the bias is not a rounding matter: the worst component misses by >= 100x."""
    verdict = checks.parity(runner.run(control("mean_of_local_means"), "uneven", 2))
    assert verdict.worst_ratio is not None and verdict.worst_ratio >= 100
    assert verdict.max_error is not None and verdict.max_error > 1e-4


def test_the_mean_of_local_means_passes_on_balanced_windows() -> None:
    """Equal token counts on every rank hide the bias: why a balanced fixture alone proves nothing."""
    assert checks.parity(runner.run(control("mean_of_local_means"), "balanced", 2)).passed


def test_the_mean_of_local_means_passes_at_world1() -> None:
    """With one rank the mean of means is the token mean: why the W=1 lane is only a sanity check."""
    assert checks.parity(runner.run(control("mean_of_local_means"), "uneven", 1)).passed


@pytest.mark.parametrize("world_size", (1, 2, 3), ids=lambda w: f"world{w}")
def test_an_extra_division_by_the_microbatch_count_fails_parity(world_size: int) -> None:
    """Dividing the globally normalized loss again by the accumulation steps halves the gradient (2.5 -> 1.25)."""
    assert not checks.parity(runner.run(control("extra_microbatch_division"), "uneven", world_size)).passed


@pytest.mark.parametrize("world_size", (2, 3), ids=lambda w: f"world{w}")
def test_leaving_out_the_world_size_factor_fails_parity(world_size: int) -> None:
    """S_r / N under DDP's averaging divides by W once too often."""
    assert not checks.parity(runner.run(control("no_world_size_factor"), "uneven", world_size)).passed


def test_leaving_out_the_world_size_factor_passes_at_world1() -> None:
    """At W=1 the factor is 1: only a multi-rank run can catch its absence."""
    assert checks.parity(runner.run(control("no_world_size_factor"), "uneven", 1)).passed


@pytest.mark.parametrize("world_size", (2, 3), ids=lambda w: f"world{w}")
def test_a_rank_skipping_its_backward_when_empty_fails_without_hanging(world_size: int) -> None:
    """The empty rank leaves DDP's all-reduce unmatched: the run is stopped within its deadline and reported."""
    verdict = checks.parity(runner.run(control("skip_backward_when_empty"), "one_empty", world_size, deadline=6))
    assert not verdict.passed
    assert "the run" in verdict.message and "rank" in verdict.message


@pytest.mark.parametrize("world_size", (1, 2, 3), ids=lambda w: f"world{w}")
def test_never_using_no_sync_fails_the_synchronization_count(world_size: int) -> None:
    """Synchronizing on every microbatch is caught by the count of synchronizations per window."""
    verdict = checks.one_sync(runner.run(control("never_no_sync"), "short_final", world_size))
    assert not verdict.passed
    assert "synchronized gradients 2 times" in verdict.message


def test_never_using_no_sync_is_invisible_to_parity() -> None:
    """Its gradients agree with the reference: parity alone cannot see a missing no_sync (FACTS.md)."""
    assert checks.parity(runner.run(control("never_no_sync"), "uneven", 2)).passed


def test_a_float32_loss_passes_in_float32_but_fails_the_float64_lane() -> None:
    """A downcast is invisible at float32 tolerances; the strict float64 lane rejects it."""
    assert checks.parity(runner.run(control("float32_loss"), "uneven", 2, "fp32")).passed
    verdict = checks.parity(runner.run(control("float32_loss"), "uneven", 2, "fp64"))
    assert not verdict.passed
    assert verdict.worst_ratio is not None and verdict.worst_ratio > 10


@pytest.mark.parametrize("world_size", (2, 3), ids=lambda w: f"world{w}")
def test_a_rank_local_logged_loss_fails_the_logged_loss_check(world_size: int) -> None:
    """Logging this rank's own token mean instead of the global one is caught, though its gradients are right."""
    run = runner.run(control("local_logged_loss"), "consecutive", world_size)
    assert checks.parity(run).passed
    assert not checks.logged_loss(run).passed


def test_the_correct_recipe_refuses_an_empty_window_where_a_control_does_not() -> None:
    """The empty-window check rejects a recipe that silently backpropagates zero (mean of means with max(n, 1))."""
    assert checks.empty_window(runner.run(control("global_token_mean"), "all_empty", 2)).passed
    assert not checks.empty_window(runner.run(control("mean_of_local_means"), "all_empty", 2)).passed


def test_a_failure_message_names_check_world_window_precision_and_numbers() -> None:
    """The message says what differs: check, world size, window, precision, max error, ratio, components over."""
    message = checks.parity(runner.run(control("mean_of_local_means"), "uneven", 2)).message
    for part in ("check parity FAILED", "world 2", "window 0", "fp32", "max abs error", "worst ratio",
                 "components over tolerance"):
        assert part in message


def test_ranks_agree_rejects_ranks_that_step_from_different_weights() -> None:
    """The rank-agreement check compares parameters bitwise; a run whose ranks disagree is rejected."""
    good = runner.run(control("global_token_mean"), "consecutive", 2)
    assert good.records is not None
    rec = good.records[1][0]
    skewed = type(rec)(**{**rec.__dict__, "params_after": rec.params_after + 1e-7})
    bad = runner.Run(good.recipe, good.scenario, 2, good.precision, good.windows,
                     [good.records[0], [skewed, *good.records[1][1:]]], good.references)
    assert checks.ranks_agree(good).passed
    assert not checks.ranks_agree(bad).passed


def test_hygiene_rejects_a_recipe_that_touches_the_rng_or_the_mode() -> None:
    """The hygiene check fails when a rank reports a changed RNG state or mode."""
    good = runner.run(control("global_token_mean"), "uneven", 2)
    assert good.records is not None
    rec = good.records[0][0]
    for change in ({"rng_changed": True}, {"mode_changed": True}, {"grad_dtypes": ("torch.float16",)}):
        bad = runner.Run(good.recipe, good.scenario, 2, good.precision, good.windows,
                         [[type(rec)(**{**rec.__dict__, **change})], good.records[1]], good.references)
        assert not checks.hygiene(bad).passed, change


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("recipe", "says"),
    [
        ("no_such_package.module:attr", "importing 'no_such_package.module' failed"),
        ("harness.recipes:no_such_attr", "has no attribute 'no_such_attr'"),
        ("harness.recipes", "must look like 'package.module:attr'"),
        ("harness.recipes:MeanOfLocalMeans.name", "has no backward_window"),
    ],
    ids=["missing-module", "missing-attr", "no-colon", "not-a-recipe"],
)
def test_a_bad_recipe_option_is_a_usage_error_naming_the_problem(recipe: str, says: str) -> None:
    """--recipe is checked in the parent before any rank starts: exit code 4 and a one-line reason."""
    done = _pytest("-m", "recipe", f"--recipe={recipe}", "harness/battery", "-q")
    assert 4 == done.returncode, done.stdout + done.stderr
    assert says in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("workers", ([], ["-n", "2"]), ids=["serial", "xdist"])
def test_the_battery_rejects_a_control_end_to_end_and_writes_its_report(tmp_path: Path, workers: list[str]) -> None:
    """`pytest -m recipe --recipe=<control>` fails, and --battery-report records which checks failed (also when
    pytest-xdist spreads the checks over workers: the controller writes every verdict)."""
    report = tmp_path / "battery.json"
    done = _pytest("-m", "recipe", "--recipe=harness.recipes:no_world_size_factor", f"--battery-report={report}",
                   "harness/battery", "-q", "-k", "uneven", *workers)
    assert 1 == done.returncode, done.stdout + done.stderr
    import json

    data = json.loads(report.read_text())
    failed = {(c["world_size"], c["precision"]) for c in data["checks"] if not c["passed"]}
    assert {(2, "fp32"), (3, "fp32"), (2, "fp64"), (3, "fp64")} == failed
    assert 6 == len(data["checks"])  # parity on the uneven windows at W = 1, 2, 3 in fp32 and fp64
