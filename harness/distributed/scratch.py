"""Each launch's private folder (the FileStore of the rendezvous, the ranks' stack dumps and output), named after the
calling process, so that a folder left by a caller that was SIGKILLed (its ``finally`` never ran) is removed by the
next launch of any process on the machine.

A folder is ``<tmp>/harness-launch-<pid>-t<start>-<random>``: the caller's pid and its start time (:func:`start_time`),
because a pid alone is reused by the system, and a later process holding it would keep a dead caller's folder forever.
:func:`sweep` removes a folder when

* its pid runs no process (or a zombie), or runs one that started at another time than the name says;
* its name has a pid but no start time (the layout of older versions, or a machine where no start time could be read)
  and the process holding that pid started after the folder was last changed;
* its name has no pid at all and nothing in it changed for :data:`MAX_AGE_S` seconds.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time

PREFIX = "harness-launch-"
_NAME = re.compile(re.escape(PREFIX) + r"(?P<pid>[0-9]+)-(?:t(?P<start>[0-9]+)-)?")
MAX_AGE_S = 3600.0
"""A launch folder whose name carries no pid is removed once nothing in it has changed for this long."""
PROC = "/proc"
"""Where process information is read (Linux); without it the start time comes from ``ps``."""
_SLACK_S = 2.0
"""Tolerance when comparing a folder's modification time with a process's start (clock and rounding jitter)."""

_own: tuple[int, int | None] | None = None


def make() -> str:
    """A new folder for one launch of this process: ``<tmp>/harness-launch-<pid>-t<start>-<random>`` (without
    ``t<start>-`` where this process's start time cannot be read)."""
    sweep()
    pid = os.getpid()
    start = own_start_time()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-" if start is None else f"{PREFIX}{pid}-t{start}-")


def own_start_time() -> int | None:
    """:func:`start_time` of this process, read once per process (a forked child reads its own)."""
    global _own
    pid = os.getpid()
    if _own is None or _own[0] != pid:
        _own = (pid, start_time(pid))
    return _own[1]


def sweep(root: str | None = None) -> list[str]:
    """Remove the launch folders in ``root`` (the temporary folder by default) that no running launch can own (see the
    module's docstring); return the paths removed. A folder of a live caller, or of another user, is left alone."""
    root = tempfile.gettempdir() if root is None else root
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path) or not stale(path, now):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def stale(path: str, now: float | None = None) -> bool:
    """Whether the launch folder ``path`` belongs to no running launch (the rules of the module's docstring)."""
    now = time.time() if now is None else now
    match = _NAME.match(os.path.basename(path))
    if match is None:
        changed = _last_change(path)
        return changed is not None and now - changed > MAX_AGE_S
    pid = int(match["pid"])
    if not pid_alive(pid):
        return True
    if match["start"] is not None:
        running = start_time(pid)
        return running is not None and running != int(match["start"])
    started, changed = started_at(pid), _last_change(path)
    return started is not None and changed is not None and changed < started - _SLACK_S


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended). A process of another user counts as
    alive: what it left is not ours to judge. A pid no process can have (0, negative, too large) is not alive. The one
    answer to this question in the package: launch folders (:func:`stale`), the audit of a run directory's temporaries
    (:func:`harness.resume.checkpoint.audit_run_dir`) and the outputs' swap leftovers use it."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, OSError):
        return False  # no such pid can exist
    with contextlib.suppress(OSError, IndexError), open(f"{PROC}/{pid}/stat") as f:
        return f.read().rsplit(") ", 1)[1][:1] != "Z"
    return True


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, as a whole number that two processes holding the same pid in turn do not share:
    field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), or where there is no ``/proc``, the start ``ps`` reports
    (whole seconds since the epoch). None when unknown: no such process, or neither source answers."""
    try:
        with open(f"{PROC}/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return _ps_start(pid) if not os.path.isdir(f"{PROC}/self") else None
    except OSError:
        return None
    try:
        return int(stat.rsplit(") ", 1)[1].split()[19])  # fields after "(comm) " start at field 3
    except (IndexError, ValueError):
        return None


def started_at(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (within a second or two); None when unknown."""
    start = start_time(pid)
    if start is None or not os.path.isdir(f"{PROC}/self"):
        return None if start is None else float(start)  # ps's figure is already in seconds since the epoch
    try:
        with open(f"{PROC}/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _ps_start(pid: int) -> int | None:
    """Start of process ``pid`` from ``ps -o lstart=`` (e.g. ``Mon Dec  1 01:43:02 2026``, local time), in seconds
    since the epoch; None where ``ps`` is missing, fails or knows no such process."""
    try:
        done = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True, timeout=10,
                              env={**os.environ, "LC_ALL": "C"}, check=False)
        return int(time.mktime(time.strptime(" ".join(done.stdout.split()), "%a %b %d %H:%M:%S %Y")))
    except (OSError, subprocess.SubprocessError, ValueError, OverflowError):
        return None


def _last_change(path: str) -> float | None:
    """The newest modification time of ``path`` and of the entries directly in it; None if it cannot be read."""
    try:
        newest = os.lstat(path).st_mtime
        with os.scandir(path) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    except OSError:
        return None
    return newest
