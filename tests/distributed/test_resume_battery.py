"""The resume battery through real ranks: the harness's trainer and both examples pass; every negative control fails
with the differing state named, through the battery, the ``resume`` command and the report's resume step.

The test command keeps one representative of each: the harness's trainer on a kill inside the save
(tests/distributed/test_resume_verdicts.py); the Python/numpy RNG control and the checkpoints labelled from 0 through
``python -m harness resume`` (in-process). The slow
tier runs every control through every case, both examples through ``pytest --pyargs harness.resume`` from another
directory, and ``report``'s resume step on each control.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.resume.battery import run_battery
from harness.resume.contract import HARNESS_TRAINER
from harness.resume.options import ResumeOptions
from harness.training.resume_controls import CAUGHT_BY, CONTROLS
from harness.workflow.cli import main
from harness.workflow.resume import resume_battery

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"steps": 16, "every": 5}  # the least the battery allows at every=5, still with a stop between checkpoints

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize(("control", "says"), [("python_numpy_rng", "the global generator ['python']"),
                                               ("labels_from_0", "a resumed run that counts from 0 labels")])
def test_a_resume_mistake_of_the_harness_trainer_turns_the_resume_command_red(
    control: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Negative controls of the default tier's battery on the harness's trainer (test_resume_verdicts.py): Python's
    and numpy's generators not restored (named after the battery's draws, not found by luck), and a resumed run that
    labels its checkpoints from 0."""
    code = main(["resume", "--trainer", CONTROLS[control], "--resume-steps", "16", "--resume-every", "5",
                 "--resume-cases", "kill-in-save"])
    out = capsys.readouterr()
    assert 1 == code
    assert "FAILED: resume: kill-in-save:" in out.err
    assert says in out.err


@pytest.mark.slow
def test_a_checkpoint_whose_data_position_disagrees_with_its_name_is_refused() -> None:
    """Negative control: a data position saved one step short; the labels check names the folder and both steps."""
    report = run_battery(CONTROLS["position_off_by_one"], ResumeOptions(**SMALL, cases=("stop-resume",)))
    (failure, *_) = report.failures()
    assert "stop-resume" == failure.case
    assert "labels of this checkpoint disagree" in failure.message or "labels disagree" in failure.message


@pytest.mark.slow
def test_a_save_that_is_not_atomic_is_caught_by_the_kill_inside_the_save_alone() -> None:
    """Negative control: state overwritten in place beside the checkpoints passes a planned stop, fails the kill."""
    report = run_battery(CONTROLS["not_atomic"], ResumeOptions(**SMALL, cases=("stop-resume", "kill-in-save")))
    status = {r.case: r for r in report.results}
    assert status["stop-resume"].passed, status["stop-resume"].message
    assert not status["kill-in-save"].passed
    assert "the checkpoint is of step 10" in status["kill-in-save"].message  # it loaded step 15's overwritten state


# ------------------------------------------------------------------------------------------------------ slow tier


@pytest.mark.slow
@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_every_control_fails_the_full_battery_and_turns_the_report_red(control: str) -> None:
    """Through the report's resume step (the same battery): not passed, the first failure names a state or label.
    Each runs the cases that catch it (after ``repeatable``, which always runs) at the battery's smallest size: the
    slow tier's budget; ``report`` itself runs every case."""
    cases = CAUGHT_BY.get(control, ("stop-resume",))
    check, payload = resume_battery(CONTROLS[control], ResumeOptions(**SMALL, cases=tuple(cases)))
    assert not check.passed, payload["table"]
    failed = [c["case"] for c in payload["cases"] if c["status"] != "pass"]
    assert set(CAUGHT_BY.get(control, ("stop-resume",))) <= set(failed), payload["table"]
    assert any(word in check.detail for word in ("differs", "labels", "disagree")), check.detail


@pytest.mark.slow
def test_the_report_step_passes_on_the_harness_trainer() -> None:
    """The control of the previous test: the unmodified trainer passes every case of the same step."""
    check, payload = resume_battery(HARNESS_TRAINER)
    assert check.passed, payload["table"]


@pytest.mark.slow
@pytest.mark.parametrize("example", ["plain", "dcp"])
def test_an_example_trainer_passes_the_pyargs_battery_from_another_directory(example: str, tmp_path: Path) -> None:
    """``pytest --pyargs harness.resume --trainer=harness.resume.examples.<name>:build`` outside the checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "harness.resume",
         f"--trainer=harness.resume.examples.{example}:build", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    assert "8 passed" in done.stdout
