"""``python -m harness audit -- torchrun ... train.py``: a plain DDP script (tests/scripts/ddp_train.py), not one line
changed, run under torchrun with two gloo ranks and the audit loaded through ``sitecustomize``. The right script exits
0; the one that divides by each rank's own token count exits 1 with the mean-of-local-means reading and its fix; a
script that fails, one that outlives the deadline and a missing command are named and never judged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "ddp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]


def audit(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", "audit", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=180, check=False)


@pytest.mark.parametrize(("wrong", "status", "said"), [
    ((), 0, "every audited window's gradient is the reference's"),
    pytest.param(("--wrong", "local_count"), 1, "reading (mean_of_local_means)", marks=pytest.mark.slow),
])
def test_an_unchanged_ddp_script_is_judged_under_torchrun(tmp_path: Path, wrong: tuple[str, ...], status: int,
                                                          said: str) -> None:
    done = audit("--windows", "2", "--", *TORCHRUN, str(SCRIPT), *wrong, cwd=tmp_path)
    assert status == done.returncode, done.stdout + done.stderr
    assert said in done.stdout, done.stdout
    assert 4 == done.stdout.count("parity "), done.stdout  # two windows on each of the two ranks
    if wrong:
        assert "fix: divide each microbatch's loss sum by the window's supervised count" in done.stdout
    assert [] == list(tmp_path.iterdir())  # nothing written where the script ran


@pytest.mark.slow
@pytest.mark.parametrize(("wrong", "said"), [
    ("accumulation_mean", "reading (per_microbatch_mean)"),
    ("never_no_sync", "one_sync FAILED: the gradient was synchronized in 2 of the window's 2 model calls; expected 1"),
])
def test_the_other_realistic_mistakes_of_the_ddp_script_are_named(tmp_path: Path, wrong: str, said: str) -> None:
    """Each microbatch's mean over the accumulation steps, and a loop without no_sync (its gradient is right: only
    the count of synchronizations shows it)."""
    done = audit("--", *TORCHRUN, str(SCRIPT), "--wrong", wrong, cwd=tmp_path)
    assert 1 == done.returncode, done.stdout + done.stderr
    assert said in done.stdout, done.stdout
    assert "fix: " in done.stdout


def test_a_failing_script_and_no_command_are_not_judged(tmp_path: Path) -> None:
    failed = audit("--", sys.executable, "-c", "print('boom'); raise SystemExit(3)", cwd=tmp_path)
    assert 1 == failed.returncode and "exited 3 before its audited windows ended; not judged" in failed.stdout
    assert "boom" in failed.stderr
    missing = audit(cwd=tmp_path)
    assert 2 == missing.returncode and "no command after --" in missing.stderr


@pytest.mark.slow
def test_a_late_script_and_a_stepless_one_are_not_judged(tmp_path: Path) -> None:
    late = audit("--deadline", "1", "--", sys.executable, "-c", "import time; time.sleep(60)", cwd=tmp_path)
    assert 1 == late.returncode and "ran past --deadline=1 s and was stopped" in late.stdout
    stepless = audit("--", sys.executable, "-c", "print('no optimizer here')", cwd=tmp_path)
    assert 1 == stepless.returncode and "ended before 0 + 2 optimizer steps" in stepless.stdout
