"""The audit command polls for the verdict file and reads it the moment it exists: the ranks' writer must never let it
see half of one. A write paused halfway (as a slow disk or a descheduled rank would) is read whole; the same pause in
a plain write is the negative control, read half-written."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.audit.capture import VERDICT, write_verdict
from harness.workflow.audit import _wait

FOUND = {"passed": True, "lines": ["audit: every window's gradient is the reference's"] * 40}


class Running:
    """A script that ends once ``done`` is set (exit status 0)."""

    def __init__(self, done: threading.Event) -> None:
        self.done, self.returncode = done, None

    def wait(self, timeout: float) -> int:
        if not self.done.wait(timeout):
            raise subprocess.TimeoutExpired("script", timeout)
        self.returncode = 0
        return 0


def plain_write(folder: Path, found: dict[str, object], midway: Callable[[], None]) -> None:
    data = json.dumps(found)
    with open(folder / VERDICT, "w") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        midway()
        f.write(data[len(data) // 2:])


def read_while_written(tmp_path: Path, writer: Callable[..., None]) -> dict[str, object] | None:
    done = threading.Event()

    def write() -> None:
        writer(tmp_path, FOUND, midway=lambda: time.sleep(0.5))
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    try:
        found, _ = _wait(Running(done), tmp_path / VERDICT, deadline=30.0, start=time.monotonic())  # type: ignore[arg-type]
    finally:
        thread.join()
    return found


def test_a_verdict_paused_halfway_is_read_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert FOUND == read_while_written(tmp_path, write_verdict)
    assert FOUND["lines"][0] in capsys.readouterr().out
    assert [VERDICT] == [p.name for p in tmp_path.iterdir()]  # no temporary left behind


def test_a_plain_write_paused_halfway_is_read_half_written(tmp_path: Path) -> None:
    with pytest.raises(json.JSONDecodeError):
        read_while_written(tmp_path, plain_write)
