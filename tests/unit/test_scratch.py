"""Launch folders: a folder is removed when no running launch can own it (its caller died, its pid now runs another
process, or it carries no pid and is old), and the folder of a live caller stays."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.distributed import scratch

pytestmark = pytest.mark.timeout(60)

HOUR = 3600.0


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    return child.pid


def _folder(root: Path, name: str, age_s: float = 0.0) -> Path:
    path = root / name
    path.mkdir()
    (path / "store").write_text("rendezvous")
    if age_s:
        past = time.time() - age_s
        os.utime(path / "store", (past, past))
        os.utime(path, (past, past))
    return path


def _mine() -> str:
    start = scratch.own_start_time()
    assert start is not None, "this machine reads no process start time"
    return f"{scratch.PREFIX}{os.getpid()}-t{start}-"


def test_a_folder_of_a_dead_caller_is_removed(tmp_path: Path) -> None:
    """The pid in the name runs no process: removed, whatever its start time says."""
    dead = _dead_pid()
    assert not scratch.pid_alive(dead)
    gone = _folder(tmp_path, f"{scratch.PREFIX}{dead}-t12345-abcd1234")
    legacy = _folder(tmp_path, f"{scratch.PREFIX}{dead}-abcd1234")
    assert sorted([str(gone), str(legacy)]) == sorted(scratch.sweep(str(tmp_path)))
    assert [] == list(tmp_path.iterdir())


def test_a_folder_whose_pid_was_reused_is_removed(tmp_path: Path) -> None:
    """Same pid as a live process (this one) but another start time: the caller that made it is gone."""
    start = scratch.own_start_time()
    assert start is not None
    reused = _folder(tmp_path, f"{scratch.PREFIX}{os.getpid()}-t{start + 1}-abcd1234")
    assert [str(reused)] == scratch.sweep(str(tmp_path))
    assert not reused.exists()


def test_a_legacy_folder_older_than_the_process_holding_its_pid_is_removed(tmp_path: Path) -> None:
    """A name with a pid and no start time (older versions): stale when it was last changed before that pid's process
    started, kept when it could be that process's."""
    started = scratch.started_at(os.getpid())
    assert started is not None and abs(time.time() - started) < 30 * 24 * HOUR
    before = _folder(tmp_path, f"{scratch.PREFIX}{os.getpid()}-abcd1234", age_s=time.time() - started + HOUR)
    after = _folder(tmp_path, f"{scratch.PREFIX}{os.getpid()}-efgh5678")
    assert [str(before)] == scratch.sweep(str(tmp_path))
    assert after.is_dir()


def test_a_folder_without_a_pid_is_removed_only_when_old(tmp_path: Path) -> None:
    """No pid in the name: nothing to ask, so age decides; a recent file inside keeps it."""
    old = _folder(tmp_path, f"{scratch.PREFIX}nopid-old", age_s=2 * HOUR)
    recent = _folder(tmp_path, f"{scratch.PREFIX}nopid-recent", age_s=10.0)
    touched = _folder(tmp_path, f"{scratch.PREFIX}nopid-touched", age_s=2 * HOUR)
    (touched / "stack-0.txt").write_text("written just now")
    assert [str(old)] == scratch.sweep(str(tmp_path))
    assert recent.is_dir() and touched.is_dir()


def test_the_folder_of_a_live_caller_is_left_alone(tmp_path: Path) -> None:
    """This process's own folder (right pid, right start time), even an old one, and unrelated names stay."""
    live = _folder(tmp_path, f"{_mine()}abcd1234", age_s=2 * HOUR)
    other = _folder(tmp_path, "not-a-launch-folder", age_s=2 * HOUR)
    assert [] == scratch.sweep(str(tmp_path))
    assert live.is_dir() and other.is_dir()


def test_make_names_the_folder_after_this_process_and_its_start(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """make() records pid and start time, and a sweep by another launch keeps the folder."""
    monkeypatch.setattr(scratch.tempfile, "tempdir", str(tmp_path))
    made = Path(scratch.make())
    try:
        assert made.parent == tmp_path and made.name.startswith(_mine())
        assert not scratch.stale(str(made))
        assert [] == scratch.sweep(str(tmp_path))
    finally:
        made.rmdir()


def test_a_zombie_is_not_alive(zombie_pid: int) -> None:
    """A child that exited and was not reaped yet still answers signal 0, but it has ended."""
    os.kill(zombie_pid, 0)  # the pid still exists
    assert not scratch.pid_alive(zombie_pid)


def test_a_pid_that_cannot_exist_is_not_alive() -> None:
    """A name with a pid beyond what the system allows is a dead caller, not an error."""
    assert not scratch.pid_alive(10**30)
    assert not scratch.pid_alive(0)


def test_without_proc_the_start_time_comes_from_ps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no /proc, ps gives the start (seconds since the epoch): stable for one process, and the same
    second as /proc's figure."""
    if subprocess.run(["ps", "-o", "lstart=", "-p", str(os.getpid())], capture_output=True, timeout=10).returncode:
        pytest.skip("no ps that knows -o lstart on this machine")
    from_proc = scratch.started_at(os.getpid())
    monkeypatch.setattr(scratch, "PROC", "/nonexistent-proc")
    first, second = scratch.start_time(os.getpid()), scratch.start_time(os.getpid())
    assert first is not None and first == second
    assert from_proc is not None and abs(first - from_proc) <= 2
    assert scratch.start_time(_dead_pid()) is None
    assert scratch.started_at(os.getpid()) == float(first)
