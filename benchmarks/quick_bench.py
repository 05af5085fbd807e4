"""``--quick`` against the full default battery for the correct recipe, as a user runs them: each a fresh
``python -m harness battery --recipe harness.recipes:global_token_mean [--quick]`` process (start-up, the model's probe
and the forkserver included), alternated so that both see the same load.

    python benchmarks/quick_bench.py [--repeats 3] [--out benchmarks/results/quick.json]

Writes the medians, their ranges and the ratio (full / quick) as JSON and prints them. ``--quick`` is meant to answer
in under 10 s on two idle cores: on a shared machine read the ratio, not the absolute figures. Not a test: nothing here
asserts a speed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from _common import RESULTS, ROOT, command, machine, now, summary, write_result

RECIPE = "harness.recipes:global_token_mean"
WAYS = {"quick": ["--quick"], "full": []}
"""The two commands, by name: the same recipe, with and without ``--quick`` (every other option at its default)."""


def _measure(extra: list[str]) -> tuple[float, str]:
    argv = [sys.executable, "-m", "harness", "battery", "--recipe", RECIPE, *extra]
    start = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - start
    if done.returncode != 0:
        msg = f"{' '.join(argv[1:])} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        raise SystemExit(msg)
    said = next((ln for ln in done.stdout.splitlines() if " checks over " in ln), "")
    return wall, said.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "quick.json"))
    args = p.parse_args()
    walls: dict[str, list[float]] = {name: [] for name in WAYS}
    said: dict[str, str] = {}
    for _ in range(args.repeats):
        for name, extra in WAYS.items():  # alternated: a burst of load falls on both
            wall, said[name] = _measure(extra)
            walls[name].append(wall)
            print(f"{name}: {wall:.2f} s ({said[name]})", flush=True)
    results = {name: {"command": f"python -m harness battery --recipe {RECIPE} {' '.join(WAYS[name])}".strip(),
                      "battery_line": said[name], **summary(walls[name], 2)} for name in WAYS}
    ratio = round(results["full"]["median_s"] / results["quick"]["median_s"], 2)
    write_result(args.out, {
        "command": command("benchmarks/quick_bench.py"),
        "what": "wall time of the command line's battery for the correct recipe on the built-in model, each run a "
                "fresh process (start-up and the model's probe included): --quick (W=2,3, fp32, the uneven, single "
                "and one_empty scenarios, the two chosen drawn layouts) and the full default battery (W=1-4, fp32 "
                "and fp64, every scenario, 12 drawn layouts)",
        "machine": machine(),
        "date": now(),
        "repeats": args.repeats,
        "results": results,
        "ratio_full_over_quick": ratio,
    })
    print(f"quick {results['quick']['median_s']} s, full {results['full']['median_s']} s (medians of "
          f"{args.repeats}); full / quick = {ratio}; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
