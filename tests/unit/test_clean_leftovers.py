"""``clean --yes`` never deletes the only copy of the runs: a process killed between the two renames of the runs-folder
swap leaves ``.old-runs-PID`` and no ``runs/``, and clean keeps that folder, says where it is and what to do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import harness.workflow.outputs as outputs
from harness.workflow.cli import main

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _outputs(folder: Path) -> Path:
    """An outputs folder as prepare leaves it, as far as clean looks: the marker and a runs/ folder."""
    folder.mkdir()
    (folder / outputs.MARKER).write_text(json.dumps({"data_lock": "test"}))
    for name in ("stopped", "continuous", "resumed"):
        (folder / "runs" / name).mkdir(parents=True)
        (folder / "runs" / name / "step-0001").write_text("old")
    return folder


def _killed_mid_swap(out: Path) -> int:
    """Run swap_dir(new, runs/) in a child process without the atomic exchange, SIGKILL it between the two renames;
    return its pid (that of a process that has ended)."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        import harness.workflow.outputs as outputs

        out = Path({str(out)!r})
        new = outputs.temp_dir(out / "runs")
        (new / "stopped").mkdir()
        outputs.exchange = lambda a, b: False
        real_replace = os.replace

        def replace_then_die(src, dst):
            real_replace(src, dst)
            os.kill(os.getpid(), signal.SIGKILL)

        outputs.os.replace = replace_then_die
        outputs.swap_dir(new, out / "runs")
        """
    )
    child = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert -signal.SIGKILL == child.returncode, child.stderr
    return _pid_of_leftover(out)


def _pid_of_leftover(out: Path) -> int:
    (old,) = out.glob(".old-runs-*")
    return int(old.name.rsplit("-", 1)[1])


def _clean(out: Path, tmp_path: Path, *extra: str) -> int:
    return main(["clean", "--scope", "generated", "--outputs", str(out), "--runs", str(tmp_path / "train-runs"),
                 *extra])


def test_clean_keeps_the_only_copy_of_the_runs_after_a_crash_in_the_swap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed after runs/ was renamed aside and before the new folder came in: clean --yes deletes the rest, keeps
    .old-runs-PID with its contents, exits 1 and tells the user to move it back or delete it by hand."""
    out = _outputs(tmp_path / "out")
    pid = _killed_mid_swap(out)
    old = out / f".old-runs-{pid}"
    assert not (out / "runs").exists() and (old / "resumed" / "step-0001").is_file()
    capsys.readouterr()

    assert 0 == _clean(out, tmp_path)  # the dry run says what it would keep
    assert f"would keep {old}/" in capsys.readouterr().err

    assert 1 == _clean(out, tmp_path, "--yes")
    said = capsys.readouterr()
    assert f"keeping {old}/" in said.err
    assert f"mv {old} {out / 'runs'}" in said.err and "delete it by hand" in said.err
    assert "kept 1" in said.out
    assert "old" == (old / "resumed" / "step-0001").read_text()
    assert not any(p.name.startswith(".tmp-") for p in out.iterdir())  # the crashed swap's new folder went

    outputs.restore_dir(out / "runs")  # what the message and the next report do
    assert "old" == (out / "runs" / "resumed" / "step-0001").read_text()


def test_clean_deletes_a_leftover_of_a_dead_swap_once_runs_exists_again(tmp_path: Path) -> None:
    """With runs/ in place the leftover is a replaced copy: --yes deletes it with the rest, exit 0."""
    out = _outputs(tmp_path / "out")
    pid = _killed_mid_swap(out)
    (out / "runs").mkdir()
    assert outputs.leftover_in_use(out / f".old-runs-{pid}") is None
    assert 0 == _clean(out, tmp_path, "--yes")
    assert [] == list(out.iterdir())


def test_clean_keeps_the_leftover_of_a_swap_still_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A live process's .old-runs-PID is a swap in progress: kept even with runs/ present."""
    out = _outputs(tmp_path / "out")
    old = out / f".old-runs-{os.getppid()}"
    old.mkdir()
    assert 1 == _clean(out, tmp_path, "--yes")
    assert f"keeping {old}/: process {os.getppid()} is still swapping" in capsys.readouterr().err
    assert old.is_dir() and not (out / "runs").exists()


def test_a_leftover_without_a_pid_is_kept_while_runs_is_missing(tmp_path: Path) -> None:
    """restore_dir would take any .old-runs-* back, so clean treats each as a possible only copy."""
    old = tmp_path / ".old-runs-by-hand"
    old.mkdir()
    assert outputs.leftover_in_use(old) is not None
    (tmp_path / "runs").mkdir()
    assert outputs.leftover_in_use(old) is None
    assert outputs.leftover_in_use(tmp_path / "runs") is None
    assert outputs.leftover_in_use(tmp_path / ".old-report-1") is None  # not a swapped folder's leftover
