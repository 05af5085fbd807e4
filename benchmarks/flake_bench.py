"""Is the distributed suite flaky? ``pytest -n 2 tests/distributed`` many times in a row on this machine.

    python benchmarks/flake_bench.py [--runs 20] [--out benchmarks/results/flake.json]

Runs the command ``--runs`` times from the checkout (the environment set up by ``scripts/setup-env.sh``), one after
another, and records each run's exit status, pytest's counts and time, its wall time and the tests that failed. A
flake is a run whose failures the next runs do not repeat: fix it at its cause, never by retrying. Not a test.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from typing import Any

from _common import RESULTS, ROOT, command, machine, now, pytest_summary, write_result

PYTEST = ["-m", "pytest", "-n", "2", "--dist", "loadgroup", "tests/distributed", "-q", "-p", "no:cacheprovider",
          "-m", "not slow"]


def one_run(python: str) -> dict[str, Any]:
    start = time.monotonic()
    done = subprocess.run([python, *PYTEST], cwd=ROOT, capture_output=True, text=True, check=False)
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.MULTILINE)))
    return {"exit_status": done.returncode, "wall_s": round(time.monotonic() - start, 1),
            **pytest_summary(done.stdout), "failed_tests": failed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS / "flake.json"))
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs={args.runs} must be at least 1")
    runs = []
    for i in range(args.runs):
        runs.append(one_run(sys.executable))
        r = runs[-1]
        print(f"run {i + 1}/{args.runs}: exit {r['exit_status']}, {r.get('counts')}, {r['wall_s']} s"
              + (f", failed: {r['failed_tests']}" if r["failed_tests"] else ""), file=sys.stderr, flush=True)
        write_result(args.out, _result(runs))  # what ran so far survives an interrupted series
    result = _result(runs)
    print(json.dumps({k: result[k] for k in ("runs_done", "failed_runs", "wall_s")}, indent=2))
    return 0 if result["failed_runs"] == 0 else 1


def _result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    walls = [r["wall_s"] for r in runs]
    return {
        "schema": "harness.flake/1",
        "command": command("benchmarks/flake_bench.py"),
        "what": "python " + " ".join(PYTEST) + ", run after run",
        "machine": machine(),
        "date": now(),
        "runs_done": len(runs),
        "failed_runs": sum(r["exit_status"] != 0 for r in runs),
        "wall_s": {"min": min(walls), "max": max(walls), "total": round(sum(walls), 1)},
        "runs": runs,
    }


if __name__ == "__main__":
    sys.exit(main())
