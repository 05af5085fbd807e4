"""Each launch's private folder (the FileStore of the rendezvous, the ranks' stack dumps), named after the calling
process, so that a folder left by a caller that was SIGKILLed (its ``finally`` never ran) is removed by the next launch
of any process on the machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

PREFIX = "harness-launch-"
_NAME = re.compile(re.escape(PREFIX) + r"(?P<pid>[0-9]+)-")


def make() -> str:
    """A new folder for one launch of this process: ``<tmp>/harness-launch-<pid>-<random>``."""
    sweep()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def sweep(root: str | None = None) -> list[str]:
    """Remove the launch folders in ``root`` (the temporary folder by default) whose calling process has ended;
    return their paths. A folder without a pid in its name, or whose process still runs, is left alone."""
    root = tempfile.gettempdir() if root is None else root
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if match is None or pid_alive(int(match["pid"])):
            continue
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended). A process of another user counts as
    alive: its folder is not ours to judge."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(") ", 1)[1][:1] != "Z"
    return True
