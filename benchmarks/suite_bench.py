"""Where the test command's time goes: ``bash scripts/test.sh`` from a fresh clone, timed, with each test's duration
and launches.

    python benchmarks/suite_bench.py [--runs 2] [--source .] [--out benchmarks/results/suite.json]

Clones ``--source`` (the checkout's committed ``HEAD``) into a temporary folder, installs there once
(``bash scripts/test.sh --co -q``: the set-up is not timed), then runs the README's test command ``--runs`` times,
each with ``-p suite_launches`` (``benchmarks/suite_launches.py``) recording every test's duration and the launches
it started. Writes, per run, the wall time, pytest's own count and time, and the outcome counts; the median wall
time; and for the last run the time and launches per file and the slowest tests. Not a test: nothing here fails on a
number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, command, machine, now, pytest_summary, write_result


def one_run(clone: Path, launches_dir: Path) -> dict[str, Any]:
    env = dict(os.environ, SUITE_LAUNCHES_DIR=str(launches_dir),
               PYTHONPATH=os.pathsep.join([str(clone / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    done = subprocess.run(["bash", "scripts/test.sh", "-q", "-p", "suite_launches"], cwd=clone, env=env,
                          capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    return {"wall_s": round(wall, 1), "exit_status": done.returncode, **pytest_summary(done.stdout),
            "tail": done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []}


def per_test(launches_dir: Path) -> dict[str, dict[str, Any]]:
    tests: dict[str, dict[str, Any]] = {}
    for f in sorted(launches_dir.glob("*.json")):
        tests.update(json.loads(f.read_text()))
    return tests


def by_file(tests: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    files: dict[str, dict[str, Any]] = defaultdict(lambda: {"seconds": 0.0, "tests": 0, "launches": 0,
                                                            "server_starts": 0})
    for nodeid, e in tests.items():
        f = files[nodeid.split("::")[0]]
        f["seconds"] += e["seconds"]
        f["tests"] += 1
        f["launches"] += e["launches"]
        f["server_starts"] += e.get("server_starts", 0)
    rows = [{"file": k, "seconds": round(v["seconds"], 1), "tests": v["tests"], "launches": v["launches"],
             "server_starts": v["server_starts"]} for k, v in files.items()]
    return sorted(rows, key=lambda r: -r["seconds"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--source", default=str(ROOT), help="the repository to clone (its committed HEAD)")
    parser.add_argument("--out", default=str(RESULTS / "suite.json"))
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs={args.runs} must be at least 1")
    with tempfile.TemporaryDirectory(prefix="suite-bench-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", args.source, str(clone)], check=True)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True,
                              check=True).stdout.strip()
        start = time.monotonic()
        subprocess.run(["bash", "scripts/test.sh", "--co", "-q"], cwd=clone, check=True, capture_output=True)
        install = time.monotonic() - start
        runs, tests = [], {}
        for i in range(args.runs):
            launches_dir = Path(tmp) / f"launches-{i}"
            launches_dir.mkdir()
            runs.append(one_run(clone, launches_dir))
            tests = per_test(launches_dir)
            print(f"run {i + 1}: {runs[-1]['wall_s']} s, {runs[-1].get('counts')}", file=sys.stderr)
    slowest = sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:30]
    starts = sum(e.get("server_starts", 0) for e in tests.values())
    result = {
        "schema": "harness.suite/1",
        "command": command("benchmarks/suite_bench.py"),
        "what": "bash scripts/test.sh -q (the README's test command: -n 2 --dist loadgroup, -m 'not slow') from a "
                "fresh clone, installed first (not timed)",
        "commit": head,
        "machine": machine(),
        "date": now(),
        "install_s": round(install, 1),
        "runs": runs,
        "median_wall_s": round(statistics.median(r["wall_s"] for r in runs), 1),
        "launches_in_process": sum(e["launches"] for e in tests.values()),
        "server_starts": starts,
        "files": by_file(tests),
        "slowest_tests": [{"test": k, "seconds": round(v["seconds"], 2), "launches": v["launches"],
                           "server_starts": v.get("server_starts", 0)} for k, v in slowest],
    }
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("median_wall_s", "runs", "launches_in_process", "server_starts")},
                     indent=2))
    return 0 if all(r["exit_status"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
