"""What the launcher benchmarks share: the checkout on ``sys.path``, timing a call, and the result file.

Imported by ``launch_bench.py``, ``preload_bench.py`` and ``resume_trio.py`` as ``_common`` (a script's own folder is
first on ``sys.path``). Importing it puts the repository root on ``sys.path``, so that ``harness`` imports from the
checkout without installing it, and ``tests/`` after it, so that the test code a benchmark launches imports as
``support.<module>`` (``tests/support/``) in the caller and in every rank: the launcher's forkserver copies
``sys.path`` when it starts, so import this module before the first launch. Every result file is JSON under
``benchmarks/results/`` with the command that made it, a machine note (cores, Python, torch) and the date, next to the
figures; the README and docs/ cite these files.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TESTS = ROOT / "tests"
for _path in (TESTS, ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    """Wall time in seconds of each of ``n`` calls of ``fn``."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def summary(times: Sequence[float], digits: int = 4) -> dict[str, Any]:
    """``{"n", "median_s", "range_s": [min, max]}`` of some wall times, rounded to ``digits``."""
    return {
        "n": len(times),
        "median_s": round(statistics.median(times), digits),
        "range_s": [round(min(times), digits), round(max(times), digits)],
    }


def command(script: str) -> str:
    """The command line that ran ``script`` (a path relative to the repository root), with its arguments."""
    return " ".join(["python", script, *sys.argv[1:]])


def machine() -> dict[str, Any]:
    """Where a figure was measured: cores, Python and torch versions."""
    import torch

    return {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def now() -> str:
    """The current UTC time, to the second (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_result(out: str | Path, result: dict[str, Any]) -> str:
    """Write ``result`` as indented JSON to ``out`` (its folder made if missing); return the text."""
    text = json.dumps(result, indent=2)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text + "\n")
    return text


SUMMARY = re.compile(r"(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s")


def pytest_summary(text: str) -> dict[str, Any]:
    """pytest's last line (``1167 passed, 92 skipped in 305.67s (0:05:05)``) as counts and seconds; empty when the
    run printed none."""
    found = None
    for line in text.splitlines():
        m = SUMMARY.search(line)
        if m:
            found = m
    if found is None:
        return {}
    counts = {w: int(n) for n, w in re.findall(r"(\d+) (\w+)", found["counts"])}
    return {"counts": counts, "pytest_s": float(found["seconds"])}
