"""How reliably the launcher stops a failing run: each failure mode N times, on 2 ranks.

    python benchmarks/reliability.py [--repeats 50] [--out benchmarks/results/reliability.json]

Modes: a rank raises; a rank is SIGKILLed; a rank skips a collective (no lockstep grace: the process-group timeout
ends it); a run outlives its deadline; an expected exception on one rank under ``lockstep_grace``. Each run must end
with its expected :class:`~harness.distributed.launcher.LaunchError` kind, within its deadline (``within_deadline``
allows ``STOP_MARGIN`` for the stack collection at a deadline; a run still going ``HANG_SLACK`` seconds past it counts
as a hang), and leave no process behind: no live descendant of the forkserver
(the ranks are its children), no child of this process, and no launch folder of this process. Writes the JSON and
prints a summary. Not a test: nothing here fails on a number.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

# The checkout, and tests/ for the failure-injecting rank bodies (support.probes, tests/support/probes.py): both before
# the first launch, since the launcher's forkserver copies sys.path when it starts.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from support import probes

from harness.distributed import scratch
from harness.distributed.launcher import LaunchError, launch

PRELOAD = (probes.__name__,)
"""The bodies' module, imported once by the forkserver: a timed launch imports nothing."""

HANG_SLACK = 30.0
"""Seconds past a run's deadline after which it counts as a hang (and the benchmark stops that mode)."""

STOP_MARGIN = 2.5
"""Seconds a run may end past its deadline and still count as within it: at the deadline the launcher spends up to 2 s
collecting each live rank's stack, then kills the ranks."""

ORPHAN_WAIT = 5.0
"""Seconds a process may take to disappear after its launch returned before it counts as an orphan."""

# name: (expected kind, deadline, the launch's arguments after fn and world size, its keyword arguments)
MODES: dict[str, tuple[str, float, Any, tuple[Any, ...], dict[str, Any]]] = {
    "rank_raises": ("raised", 30.0, probes.raise_on, (1, "RuntimeError", "boom"), {}),
    "rank_sigkilled": ("died", 30.0, probes.kill_self_on, (0,), {}),
    "rank_skips_collective": ("raised", 4.0, probes.skip_collective_on, (1,), {}),
    "past_deadline": ("deadline", 2.0, probes.sleep_on, (None, 3600.0), {}),
    "expected_exception_with_grace": (
        "desync", 60.0, probes.raise_on, (0, "ValueError", "no supervised token"),
        {"expect": (ValueError,), "lockstep_grace": 1.0},
    ),
}


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0]


def _descendants(root: int) -> list[int]:
    """Live (not zombie) processes below ``root``, from a scan of /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] != "Z":
                children.setdefault(st[0], []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _forkserver_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)  # type: ignore[attr-defined]


def _left_behind() -> tuple[list[int], list[str]]:
    """Processes and launch folders of this process still there ``ORPHAN_WAIT`` seconds after a launch."""
    mine = f"{scratch.PREFIX}{os.getpid()}-"
    end = time.monotonic() + ORPHAN_WAIT
    while True:
        server = _forkserver_pid()
        procs = sorted(set(_descendants(server) if server else []) | {p.pid for p in multiprocessing.active_children()
                                                                     if p.pid is not None})
        folders = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(mine)]
        if (not procs and not folders) or time.monotonic() > end:
            return procs, folders
        time.sleep(0.05)


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, 9)


def run_once(mode: str) -> dict[str, Any]:
    """One launch of ``mode``: what it ended with, how long it took, what it left behind."""
    _, deadline, fn, args, kwargs = MODES[mode]
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            launch(fn, 2, *args, deadline=deadline, preload=PRELOAD, **kwargs)
            outcome["kind"] = "returned"
        except LaunchError as exc:
            outcome["kind"] = exc.kind
        except BaseException as exc:
            outcome["kind"] = f"{type(exc).__name__}: {exc}"[:200]

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(deadline + HANG_SLACK)
    seconds = time.monotonic() - start
    if thread.is_alive():
        return {"kind": "hang", "seconds": seconds, "orphans": [], "folders": []}
    procs, folders = _left_behind()
    _kill_all(procs)
    return {"kind": outcome.get("kind"), "seconds": seconds, "orphans": procs, "folders": folders}


def bench(repeats: int, modes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in modes:
        kind, deadline = MODES[mode][0], MODES[mode][1]
        runs = []
        for _ in range(repeats):
            runs.append(run_once(mode))
            if runs[-1]["kind"] == "hang":
                break  # a hung launch still holds the forkserver: the rest of this mode would measure that
        seconds = [r["seconds"] for r in runs]
        out[mode] = {
            "runs": len(runs),
            "expected_kind": kind,
            "deadline_s": deadline,
            "expected_kind_seen": sum(r["kind"] == kind for r in runs),
            "other_outcomes": dict(Counter(str(r["kind"]) for r in runs if r["kind"] != kind)),
            "hangs": sum(r["kind"] == "hang" for r in runs),
            "within_deadline": sum(s <= deadline + STOP_MARGIN for s in seconds),
            "max_past_deadline_s": round(max(0.0, max(seconds) - deadline), 3),
            "runs_with_orphans": sum(bool(r["orphans"]) for r in runs),
            "orphans": sum(len(r["orphans"]) for r in runs),
            "leaked_folders": sum(len(r["folders"]) for r in runs),
            "median_s": round(statistics.median(seconds), 3),
            "max_s": round(max(seconds), 3),
        }
        row = out[mode]
        print(f"{mode:32s} {row['expected_kind_seen']:3d}/{row['runs']:<3d} {kind:8s} hangs={row['hangs']} "
              f"orphans={row['orphans']} folders={row['leaked_folders']} within-deadline={row['within_deadline']} "
              f"median={row['median_s']:.2f}s max={row['max_s']:.2f}s (deadline {deadline:g}s)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="runs per mode (default: 50)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "reliability.json"))
    opts = parser.parse_args(argv)
    modes = [m for m in opts.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or opts.repeats < 1:
        parser.error(f"unknown mode(s) {unknown}" if unknown else "--repeats must be a positive integer")
    start = time.monotonic()
    results = bench(opts.repeats, modes)
    payload = {
        "command": " ".join(["python benchmarks/reliability.py", *(argv if argv is not None else sys.argv[1:])]),
        "repeats": opts.repeats,
        "world_size": 2,
        "hang_slack_s": HANG_SLACK,
        "stop_margin_s": STOP_MARGIN,
        "orphan_wait_s": ORPHAN_WAIT,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
                   f"torch {torch.__version__}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "total_s": round(time.monotonic() - start, 1),
        "modes": results,
    }
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    bad = sum(r["runs"] - r["expected_kind_seen"] + r["orphans"] + r["leaked_folders"] for r in results.values())
    print(f"wrote {out} ({payload['total_s']} s); {'every run ended as expected' if not bad else f'{bad} problem(s)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
