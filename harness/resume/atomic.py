"""Files that survive a crash: written to a temporary name, fsynced, renamed over the final name, folder fsynced.

A reader sees the old file or the whole new one, never half of one. A kill between the write and the rename leaves the
temporary behind under the name :data:`TEMP_NAME` matches (``.NAME.tmp-PID``); ``audit_run_dir`` reports those.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")
"""A temporary of :func:`write_temp`: ``.NAME.tmp-PID``, renamed over ``NAME`` once whole, left behind by a kill."""


def write_temp(path: Path, data: bytes, midway: Callable[[], None] | None = None) -> Path:
    """Write ``data`` durably under a temporary name next to ``path``; return that name (not yet renamed).

    ``midway()`` is called once half of ``data`` is on disk: a kill there leaves what a crash in the middle of the
    write would (the resume battery's ``kill-before-commit`` kills rank 0 there, inside the manifest's write)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        _write_durably(f, data, midway)
    return tmp


def _write_durably(f: BinaryIO, data: bytes, midway: Callable[[], None] | None) -> None:
    half = len(data) // 2
    for i, part in enumerate((data[:half], data[half:])):
        f.write(part)
        f.flush()
        os.fsync(f.fileno())
        if i == 0 and midway is not None:
            midway()


def commit(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes, midway: Callable[[], None] | None = None) -> None:
    """Replace ``path`` with ``data`` so that a reader sees either the old file or the whole new one (``midway``: see
    :func:`write_temp`)."""
    commit(write_temp(path, data, midway), path)


__all__ = ["TEMP_NAME", "commit", "fsync_dir", "write_atomic", "write_temp"]
