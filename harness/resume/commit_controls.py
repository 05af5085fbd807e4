"""Negative controls of the harness's own commit machinery: each one real mistake in the pieces that make a checkpoint
survive a kill, installed in a process (a battery's ranks, or a test) in place of the right piece.

The battery judges a user's loop through this machinery, so a mistake here would pass loops it should fail, or fail
correct ones. Each control is shown rejected (``tests/distributed/test_resume_commit_controls.py``):

* ``write_in_place``: files written straight under their final name instead of a temporary renamed over it. A kill
  in the middle of the manifest's write then leaves half a manifest under its real name: the newest folder reads as
  a corrupt checkpoint, and the resume is refused (the battery's ``kill-before-commit`` case kills there).
* ``sizes_only``: a manifest whose check compares each file's size and not its SHA-256. A file changed in place at
  the same size (one flipped byte: bit rot, a straggling writer) then passes, and a rank resumes from it.
* ``trust_newest``: a discovery that takes the newest step folder without checking it. After a kill inside a save
  (the battery's ``kill-in-save`` case) that folder is half-written, and a rank resumes from it.

Never installed in a real run: :func:`install` is called by a leg whose ``commit_bug`` names one (tests only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

COMMIT_BUGS = ("write_in_place", "sizes_only", "trust_newest")

CAUGHT_BY = {"write_in_place": ("kill-before-commit",), "trust_newest": ("kill-in-save",)}
"""The battery cases that reject a control (``sizes_only`` changes nothing a battery case writes: its tests do)."""


def _write_in_place(path: Path, data: bytes, midway: Callable[[], None] | None = None) -> Path:
    from harness.resume import atomic

    with open(path, "wb") as f:  # the mistake: the final name holds half the bytes while the write goes on
        atomic._write_durably(f, data, midway)
    return path  # commit() then renames the file onto itself


def _check_size_only(path: Path, entry: Mapping[str, Any]) -> None:
    if not path.is_file() or path.stat().st_size != entry["size"]:  # the mistake: no checksum
        msg = f"{path}: missing, or not the size the manifest records; resume from another step"
        raise ValueError(msg)


def _trust_newest(run_dir: str | Path, *, allow_older: bool = True) -> Any:
    from harness.resume.checkpoint import Discovery, step_dirs

    del allow_older
    folders = step_dirs(run_dir)  # the mistake: the newest folder, complete or not
    return Discovery(folders[0] if folders else None)


def install(bug: str) -> None:
    """Put control ``bug`` in place of the right piece, in this process; ValueError naming the controls otherwise."""
    from harness.resume import atomic, checkpoint, manifest

    if bug == "write_in_place":
        atomic.write_temp = checkpoint.write_temp = _write_in_place
    elif bug == "sizes_only":
        manifest._check_file = _check_size_only
    elif bug == "trust_newest":
        checkpoint.newest_valid_checkpoint = _trust_newest
    else:
        msg = f"commit_bug={bug!r} must be one of {COMMIT_BUGS} (negative controls for tests only)"
        raise ValueError(msg)


__all__ = ["CAUGHT_BY", "COMMIT_BUGS", "install"]
