"""The outputs folder: its marker and data-lock check, the error for unusable input, and writers that survive a
crash.

Layout of an outputs folder (``--outputs``, default ``outputs/``)::

    outputs.json            marker: the data lock and config the folder was prepared from (clean and prepare read it)
    data/corpus.jsonl       every row of every split
    data/plan.json          plan[step][rank][microbatch] -> sequence ids
    reference/              the single-device control gradient (reference.pt) and its summary (reference.json)
    runs/{stopped,continuous,resumed}/step-NNNN   the trio's checkpoints
    report.md  report.json  report.png

Every file is written under a temporary name in its own folder, fsynced, renamed over the final name and the folder
fsynced (:func:`harness.resume.checkpoint.write_atomic`): a reader sees the old file or the whole new one. ``runs/``
is replaced as a whole by :func:`swap_dir`, which exchanges the two folders in one rename where the system can
(Linux ``renameat2(RENAME_EXCHANGE)``) and otherwise keeps the previous folder under ``.old-runs-PID`` until the new
one is in place; :func:`restore_dir` puts such a leftover back when a crash came between the two renames, and
``clean`` keeps it (:func:`leftover_in_use`) while it may be the only copy.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.distributed.scratch import pid_alive
from harness.resume.atomic import fsync_dir, write_atomic

MARKER = "outputs.json"


def err(msg: str) -> None:
    """A message on stderr, flushed (every command's way of saying what it does and why it failed)."""
    print(msg, file=sys.stderr, flush=True)


class BadInput(ValueError):
    """The user's input cannot be used as given (another data lock, a missing step, an incomplete checkpoint)."""


Progress = Callable[[str], None]


def silent(_message: str) -> None:
    pass


def stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ writing safely


def write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` through a fsynced temporary name in the same folder (never half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` in one atomic rename; False where the system cannot (nothing changed then)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return bool(done == 0)


def old_name(final: Path) -> Path:
    return final.with_name(f".old-{final.name}-{os.getpid()}")


def swap_dir(new: Path, final: Path) -> None:
    """Put the folder ``new`` in place of ``final``; at every instant ``final`` is the old folder or the new one.

    With an atomic exchange the old folder lands at ``new``'s name and is deleted. Without one, the old folder is
    renamed aside and ``new`` renamed in; if the second rename fails the old one is put back, and a crash between the
    two leaves it as ``.old-NAME-PID``, which :func:`restore_dir` (run before every report) renames back.
    """
    if final.exists() and exchange(new, final):
        fsync_dir(final.parent)
        shutil.rmtree(new, ignore_errors=True)
        return
    old = old_name(final)
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(new, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def restore_dir(final: Path) -> Path | None:
    """When ``final`` is missing but a crashed :func:`swap_dir` left ``.old-NAME-PID``, rename the newest one back."""
    if final.exists() or not final.parent.is_dir():
        return None
    leftovers = sorted((p for p in final.parent.glob(f".old-{final.name}-*") if p.is_dir()),
                       key=lambda p: p.stat().st_mtime)
    if not leftovers:
        return None
    os.replace(leftovers[-1], final)
    fsync_dir(final.parent)
    return leftovers[-1]


def leftover_in_use(path: Path, swapped: tuple[str, ...] = ("runs",)) -> str | None:
    """Why ``clean`` must not delete ``path``, or None where it may.

    Only a ``.old-NAME-PID`` folder that :func:`swap_dir` leaves beside a swapped folder NAME (``runs`` in an outputs
    folder) is ever kept: while process PID still runs, it is in the middle of a swap; once PID has ended, a crash came
    between the two renames, and while ``NAME`` does not exist this folder may be its only copy (:func:`restore_dir`
    would put it back, as it would any ``.old-NAME-*``). Once ``NAME`` exists again it is a replaced copy, and may go.
    """
    name = next((n for n in swapped if path.name.startswith(f".old-{n}-")), None)
    if name is None or not path.is_dir() or path.is_symlink():
        return None
    pid, final = path.name[len(f".old-{name}-"):], path.with_name(name)
    if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
        return (f"process {pid} is still swapping {final}/ with it; run clean again once that process has ended "
                f"(or, if it is not a harness process, delete {path} by hand)")
    if final.exists():
        return None
    return (f"no {final}/ exists, so this folder, left by a swap that was interrupted, may be the only copy of it; "
            f"move it back (mv {path} {final}), which the next `report` also does, or delete it by hand "
            f"(rm -r {path}) if you do not need it")


def temp_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


# ------------------------------------------------------------------------------------------------ marker and lock


def read_marker(outputs: Path) -> dict[str, Any] | None:
    path = outputs / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
        str(marker["data_lock"])
    except (ValueError, KeyError, TypeError) as exc:
        msg = f"{path}: not a valid outputs marker ({exc!r}); remove {outputs} or pass another --outputs"
        raise BadInput(msg) from None
    return dict(marker)


def check_lock(outputs: Path, lock: str, config_path: str) -> None:
    """Refuse an outputs folder prepared from other data: mixing two corpora would make every comparison meaningless."""
    marker = read_marker(outputs)
    if marker is not None and marker["data_lock"] != lock:
        msg = (
            f"--outputs {str(outputs)!r} was prepared from data lock {marker['data_lock']} "
            f"(config {marker.get('config', '?')}), but --config {config_path} gives data lock {lock}; "
            "pass another --outputs, or remove that folder (clean --scope generated --yes) to start over"
        )
        raise BadInput(msg)
