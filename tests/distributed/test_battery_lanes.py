"""The battery's two faces, pytest (``pytest -m recipe --recipe=...``) and the command line (``python -m harness
battery``), judge a recipe on the same cases with the same exit codes, and write one report format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.battery.plan import cases as plan
from harness.battery.report.table import SCHEMA

ROOT = Path(__file__).parents[2]
QUICK = ("--precision", "fp32")


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    # The user-style recipes live in tests/user_recipes, importable as user_recipes.<module>.
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _pytest_lane(recipe: str, report: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return _run("-m", "pytest", "-p", "no:cacheprovider", "-q", "harness/battery/test_battery.py", "-m", "recipe",
                f"--recipe={recipe}", f"--battery-report={report}", "--battery-world-sizes=2", *QUICK, *extra)


def _cli_lane(recipe: str, report: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return _run("-m", "harness", "battery", "--recipe", recipe, "--battery-world-sizes", "2", "--battery-examples", "0",
                "--battery-report", str(report), *QUICK, *extra)


def _keys(report: Path) -> dict[tuple[object, ...], str]:
    data = json.loads(report.read_text())
    return {(c["check"], c["scenario"], c["world_size"], c["precision"]): c["status"] for c in data["checks"]}


@pytest.mark.slow
def test_pytest_and_the_command_line_give_the_same_verdicts_and_exit_codes(tmp_path: Path) -> None:
    """Same cases, same statuses, same exit code (1: a check failed); the report records the counts. (Exit 0 for a
    correct recipe: the shipped battery's own run, and the command line's test below.)"""
    recipe, status = "harness.recipes:count_from_one_microbatch", 1
    via_pytest, via_cli = tmp_path / "pytest.json", tmp_path / "cli.json"
    done_pytest = _pytest_lane(recipe, via_pytest)
    done_cli = _cli_lane(recipe, via_cli)
    assert status == done_pytest.returncode, done_pytest.stdout[-3000:] + done_pytest.stderr[-2000:]
    assert status == done_cli.returncode, done_cli.stdout[-3000:] + done_cli.stderr[-2000:]
    assert _keys(via_pytest) == _keys(via_cli)
    expected = len(plan.cases([2], "fp32"))
    for path in (via_pytest, via_cli):
        data = json.loads(path.read_text())
        assert SCHEMA == data["schema"]
        assert (expected, expected, status, []) == (data["expected"], data["run"], data["exit_status"], data["errors"])


@pytest.mark.slow
def test_the_command_line_judges_a_user_recipe_as_a_recipe_under_test(tmp_path: Path) -> None:
    """A correct recipe given as a class exits 0 (not "control not rejected"); n/a checks show as n/a."""
    done = _run("-m", "harness", "battery", "--recipe", "user_recipes.variants:ClassRecipe",
                "--battery-world-sizes", "1", "--battery-examples", "0", *QUICK)
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-2000:]
    assert "n/a" in done.stdout and "every check holds" in done.stdout


@pytest.mark.slow
def test_the_command_line_refuses_bad_input_with_exit_2() -> None:
    """An unloadable recipe, a world size the scenarios cannot hold, an unknown control: exit 2 and the reason."""
    for args, says in ((["--recipe", "user_recipes.variants:RaisesOnEveryRank"], "calling RaisesOnEveryRank()"),
                       (["--battery-world-sizes", "9"], "--battery-world-sizes='9'"),
                       (["--battery-controls", "no_such_control"], "no_such_control")):
        done = _run("-m", "harness", "battery", *args)
        assert 2 == done.returncode, done.stdout + done.stderr
        assert says in done.stderr


def test_a_bad_recipe_option_is_a_pytest_usage_error_naming_the_problem() -> None:
    """--recipe is checked in the parent before any rank starts: exit code 4 and a one-line reason."""
    done = _run("-m", "pytest", "-p", "no:cacheprovider", "-m", "recipe",
                "--recipe=user_recipes.variants:RaisesOnEveryRank", "harness/battery", "-q")
    assert 4 == done.returncode, done.stdout + done.stderr
    assert "calling RaisesOnEveryRank() to build the recipe failed" in done.stderr


@pytest.mark.slow
def test_the_command_line_runs_controls_on_their_targets(tmp_path: Path) -> None:
    """--controls judges each named control on its targeted check; all rejected exits 0."""
    report = tmp_path / "controls.json"
    done = _run("-m", "harness", "battery", "--battery-controls", "cached_count,first_microbatch_never_syncs",
                "--battery-world-sizes", "2,3", "--battery-report", str(report))
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-2000:]
    controls = json.loads(report.read_text())["controls"]
    assert 4 == len(controls) and all(c["rejected"] for c in controls)


@pytest.mark.slow
@pytest.mark.parametrize("workers", ([], ["-n", "2"]), ids=["serial", "xdist"])
def test_the_pytest_report_counts_every_verdict_also_under_xdist(tmp_path: Path, workers: list[str]) -> None:
    """The controller writes every verdict with the expected count and the exit status, with or without -n."""
    report = tmp_path / "battery.json"
    done = _pytest_lane("harness.recipes:no_world_size_factor", report, "-k", "uneven and match", *workers)
    assert 1 == done.returncode, done.stdout + done.stderr
    data = json.loads(report.read_text())
    assert (1, 1, 1) == (data["expected"], data["run"], data["exit_status"])
    assert ["fail"] == [c["status"] for c in data["checks"]]


@pytest.mark.slow  # a pytest subprocess of over 10 s: the slow tier (CI runs it)
def test_verbose_pytest_shows_every_ranks_whole_report() -> None:
    """Under -v a failed run's verdict carries each rank's full traceback or stack, not only the summary lines."""
    done = _run("-m", "pytest", "-p", "no:cacheprovider", "-v", "harness/battery/test_battery.py", "-m", "recipe",
                "--recipe=user_recipes.broken:CrashesOnRankOne", "--battery-world-sizes=2", *QUICK,
                "-k", "uneven and match", "--battery-keep-going")
    assert 1 == done.returncode, done.stdout[-3000:] + done.stderr[-2000:]
    assert "every rank's report" in done.stdout and "Traceback (most recent call last)" in done.stdout


@pytest.mark.slow  # pytest subprocesses of about 10 s each
@pytest.mark.parametrize("workers", ([], ["-n", "2"]), ids=["serial", "xdist"])
def test_pytest_stops_a_raising_recipe_in_the_pre_flight_with_one_message(workers: list[str]) -> None:
    """Exit 1 before any test, the exception once with the recipe's line; --battery-keep-going runs the tests instead
    (the negative control), each failing on the crash."""
    args = ("-m", "pytest", "-p", "no:cacheprovider", "-q", "harness/battery/test_battery.py", "-m", "recipe",
            "--recipe=user_recipes.failfast:WrongIgnoreIndex", "--battery-world-sizes=2", *QUICK, *workers)
    done = _run(*args)
    text = done.stdout + done.stderr
    assert 1 == done.returncode, text[-3000:]
    assert 1 == text.count("IndexError: Target -100 is out of bounds."), text[-3000:]
    assert "user_recipes/failfast.py:24, in backward_window" in text and " passed" not in text
    assert "[printed by 2 ranks in 1 launch] hello from my step" in text
    going = _run(*args, "-k", "uneven and match", "--battery-keep-going")
    assert 1 == going.returncode and "1 failed" in going.stdout, going.stdout[-3000:]
