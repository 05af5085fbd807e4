"""The pre-flight and the quiet output on the command line: a raising recipe stops after one launch with one message
naming the user's line; --battery-keep-going runs the matrix and says the exception once; a correct recipe is not
launched twice for the pre-flight's case; the ranks' prints are said once with their counts (every one under -v)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.workflow.cli import main

SMALL = ["--battery-world-sizes", "1,2", "--precision", "fp32", "--battery-examples", "0", "--quick"]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Counter[RunSpec]:
    """Every launch of this test, by its spec."""
    seen: Counter[RunSpec] = Counter()
    launch = runner.launch_run

    def counting(spec: RunSpec, *args: Any, **kwargs: Any) -> Any:
        seen[spec] += 1
        return launch(spec, *args, **kwargs)

    monkeypatch.setattr(runner, "launch_run", counting)
    monkeypatch.setattr(runner, "_CACHE", {})
    return seen


def test_a_raising_recipe_stops_after_one_launch_naming_the_users_line(
        launches: Counter[RunSpec], capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 1, one launch (W=1, uneven), the exception, the recipe's file and line, the fix; torch's frame unnamed."""
    assert 1 == main(["battery", "--recipe", "user_recipes.failfast:WrongIgnoreIndex", *SMALL])
    said = capsys.readouterr()
    assert [("uneven", 1)] == [(s.scenario, s.world_size) for s in launches]
    assert 1 == said.err.count("IndexError: Target -100 is out of bounds."), said.err
    assert "user_recipes/failfast.py:24, in backward_window" in said.err
    assert "ignore_index=-100" in said.err and "functional.py" not in said.err
    assert "--battery-keep-going" in said.err
    assert "[printed by 1 rank in 1 launch] hello from my step" in said.out


def test_a_recipe_that_refuses_a_window_with_tokens_stops_in_the_pre_flight_too(
        launches: Counter[RunSpec], capsys: pytest.CaptureFixture[str]) -> None:
    """A ValueError is a refusal, fair only on a window without tokens: on one with tokens the pre-flight stops."""
    assert 1 == main(["battery", "--recipe", "user_recipes.failfast:RefusesEveryWindow", *SMALL])
    err = capsys.readouterr().err
    assert 1 == len(launches)
    assert "ValueError: this loop reads a batch key the battery does not send" in err and "window 0" in err


def test_keep_going_runs_the_matrix_and_says_the_exception_once_with_its_count(
        launches: Counter[RunSpec], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A recipe that passes alone and raises with a peer: every W=2 case crashes, one block says so; each verdict
    keeps its own message in the report, naming the recipe's line."""
    report = tmp_path / "r.json"
    assert 1 == main(["battery", "--recipe", "user_recipes.failfast:RaisesWithPeers", "--battery-keep-going", *SMALL,
                      "--battery-report", str(report)])
    crashes = [c for c in json.loads(report.read_text())["checks"] if c["cause"] == "crash"]
    assert crashes and all("failfast.py:34, in backward_window" in c["message"] for c in crashes)
    said = capsys.readouterr()
    text = said.out + said.err
    assert 1 == text.count("RuntimeError: this loop was only ever run on one device"), text
    crashed = {s.scenario for s in launches if s.world_size == 2}
    assert f"the recipe raised in {len(crashed)} cases (W=2;" in text
    assert "user_recipes/failfast.py:34, in backward_window" in text


def test_a_correct_recipe_is_launched_once_per_case_and_its_prints_are_said_once(
        launches: Counter[RunSpec], capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 0; no spec launched twice, no case launched under two specs; each print once with its counts."""
    assert 0 == main(["battery", "--recipe", "user_recipes.failfast:PrintsEveryWindow", *SMALL])
    said = capsys.readouterr()
    assert {1} == set(launches.values())
    assert len(launches) == len({(s.scenario, s.world_size, s.precision) for s in launches})
    ranks = sum(s.world_size for s in launches)
    hello = [ln for ln in (said.out + said.err).splitlines() if "hello from my step" in ln]
    assert [f"  [printed by {ranks} ranks in {len(launches)} launches] hello from my step"] == hello
    assert "every check holds" in said.out


def test_under_verbose_every_launch_relays_its_prints_as_they_come(
        launches: Counter[RunSpec], capsys: pytest.CaptureFixture[str]) -> None:
    """Negative control of the quiet default: -v relays each launch's lines, and no end-of-battery count."""
    assert 0 == main(["battery", "--recipe", "user_recipes.failfast:PrintsEveryWindow", "-v", *SMALL])
    said = capsys.readouterr()
    relayed = [ln for ln in said.err.splitlines() if ln.endswith("] hello from my step")]
    assert len(launches) == len(relayed)
    assert "printed by" not in said.out + said.err
