"""The command line's commands that start ranks, run the way a user runs them: ``python -m harness ...`` in a
subprocess with a timeout, so that nothing trains in the pytest process and a hang is a failure, not a stuck suite.

The report runs end to end on a small config (seconds); the full-size one on configs/minimum.yaml is marked ``slow``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.data.config import load_config
from harness.distributed.launcher import launch
from harness.training.trainer import launched_run

ROOT = Path(__file__).resolve().parents[2]
MINIMUM = str(ROOT / "configs" / "minimum.yaml")
EXERCISE = str(ROOT / "configs" / "exercise.yaml")

SMALL = ROOT / "configs" / "small.yaml"


def harness(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def small() -> str:
    return str(SMALL)


@pytest.mark.slow  # a subprocess run of over 10 s: the slow tier (CI runs it)
def test_exercise_shows_the_averages_move_and_only_the_mean_of_means_misses_at_12_36() -> None:
    """Seed 000's exercise on two real ranks: both normalizations match at 12/12; at 12/36 only the token mean does."""
    done = harness("exercise", "--config", EXERCISE)
    assert 0 == done.returncode, done.stderr
    out = done.stdout
    assert "tokens [12, 36]: mean of means 2, global token mean 2.5" in out
    assert "global_token_mean    tokens [12, 36]" in out and "matches" in out
    assert [line for line in out.splitlines() if "mean_of_local_means  tokens [12, 36]" in line and "MISSES" in line]


@pytest.mark.slow
def test_check_environment_dual_meets_two_ranks_and_says_why_gpu2_cannot_run() -> None:
    """--dual all-reduces across two gloo ranks and names what the gpu2 lane lacks (or that it can run)."""
    done = harness("check-environment", "--config", MINIMUM, "--dual")
    assert 0 == done.returncode, done.stderr
    assert "two gloo ranks met and all-reduced 1 + 2 = 3" in done.stdout
    lane = [line for line in done.stdout.splitlines() if line.startswith("gpu2 lane")]
    assert lane and ("needs 2 CUDA devices, found" in lane[0] or "can run here" in lane[0] or "NCCL" in lane[0])


@pytest.mark.slow  # a subprocess run of over 10 s: the slow tier (CI runs it)
def test_evaluate_reports_test_loss_accuracy_and_tokens_of_a_run_directory(small: str, tmp_path: Path) -> None:
    """A short run trained on two ranks, then evaluate on its newest checkpoint through the launcher."""
    config = load_config(small)
    launch(launched_run, 2, config, str(tmp_path / "run"), {}, deadline=120.0)
    done = harness("evaluate", "--config", small, "--run-dir", str(tmp_path / "run"))
    assert 0 == done.returncode, done.stderr
    assert "(step 20), 2 ranks" in done.stdout
    assert "valid tokens" in done.stdout and "over 32 test sequences" in done.stdout


@pytest.mark.slow  # a subprocess run of over 10 s: the slow tier (CI runs it)
def test_report_on_a_small_config_writes_markdown_json_and_figure_and_passes(small: str, tmp_path: Path) -> None:
    """The whole protocol, quick: exit 0, every check PASS, numbers in report.json, a PNG beside it."""
    out = tmp_path / "out"
    done = harness("report", "--config", small, "--outputs", str(out), "--battery-controls", "mean_of_local_means",
                   "--scaling-steps", "3")
    assert 0 == done.returncode, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"report: every check holds; read {out / 'report.md'}"
    assert "[report 5/9]" in done.stderr  # progress goes to stderr
    result = json.loads((out / "report.json").read_text())
    assert result["passed"] is True
    assert 0.0 == result["resume"]["max_abs_difference_all"]
    assert result["parity"]["global_token_mean"]["passed"] and not result["parity"]["mean_of_local_means"]["passed"]
    assert [1, 2, 4] == [row["world_size"] for row in result["scaling"]["rows"]]
    assert 1.0 == result["scaling"]["rows"][0]["efficiency"]
    assert result["evaluate"]["test_tokens"] > 0
    md = (out / "report.md").read_text()
    assert "| components compared | " in md and "CPU figures on this machine" in md
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary names left behind"
    check = harness("check-checkpoints", "--outputs", str(out))
    assert 0 == check.returncode, check.stderr


@pytest.mark.slow
def test_report_on_the_minimum_config_answers_seed_000s_questions(tmp_path: Path) -> None:
    """Full size: 2 ranks, 100 updates, every negative control in the battery; exit 0 and a bitwise-equal resume."""
    out = tmp_path / "out"
    done = harness("report", "--config", MINIMUM, "--outputs", str(out), timeout=600)
    assert 0 == done.returncode, done.stderr[-3000:]
    result = json.loads((out / "report.json").read_text())
    assert 0.0 == result["resume"]["max_abs_difference_all"]
    assert 256 == result["evaluate"]["test_sequences"]
    assert all(c["passed"] for c in result["checks"])
