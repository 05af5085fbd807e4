"""The whole battery for one recipe, as a user runs it: every case of the plan (W = 1-4, float32 and float64) and the
drawn-layout lane, each measurement in a fresh process (forkserver start included).

    python benchmarks/battery_bench.py [--repeats 3] [--examples 12] [--out benchmarks/results/battery.json]

Three recipes: the correct one shipped in ``harness.recipes``, and a copy of ``examples/token_mean_recipe.py`` whose
module also imports ``matplotlib.pyplot`` at import time (a heavy library of this environment, standing in for
transformers), run once with the recipe's module preloaded into the forkserver (what the battery does) and once
without (each rank of each launch imports it). Writes medians and the ratio as JSON and prints them. The machine is
shared and noisy: read the ratio, not the absolute figures. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RUN = """
import os, sys, time
from harness.battery.plan import cases as plan
from harness.battery.launch import runner
from harness.battery.plan.options import BatteryOptions
from harness.battery.layouts import drawn_verdicts
from harness.battery.report.table import run_cases
if os.environ.get("BENCH_NO_PRELOAD") == "1":
    runner.recipe_module = lambda spec: None  # every rank of every launch imports the recipe's module itself
recipe, examples = sys.argv[1], int(sys.argv[2])
start = time.monotonic()
verdicts = run_cases(recipe, plan.cases())
if examples:
    verdicts += drawn_verdicts(recipe, BatteryOptions(examples=examples), derandomize=True)  # fp32 and fp64
failed = [v for v in verdicts if not v.passed]
print(f"RESULT {len(verdicts)} {len(failed)} {time.monotonic() - start:.3f}")
"""


def _measure(recipe: str, examples: int, env: dict[str, str]) -> tuple[float, float, int, int]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _RUN, recipe, str(examples)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    wall = time.monotonic() - t0
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"battery run of {recipe} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    _, n, failed, inner = line.split()
    return wall, float(inner), int(n), int(failed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--examples", type=int, default=12, help="drawn layouts per battery (the pytest default)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "battery.json"))
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="battery-bench-"))
    try:
        source = (ROOT / "examples" / "token_mean_recipe.py").read_text()
        heavy = source + "\nimport matplotlib\n\nmatplotlib.use('Agg')\nimport matplotlib.pyplot\n"
        (tmp / "heavy_import_recipe.py").write_text(heavy)
        base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)])}
        ways = {
            "correct recipe (harness.recipes:global_token_mean)": ("harness.recipes:global_token_mean", base),
            "heavy-import recipe, module preloaded": ("heavy_import_recipe:recipe", base),
            "heavy-import recipe, imported per launch": ("heavy_import_recipe:recipe",
                                                         {**base, "BENCH_NO_PRELOAD": "1"}),
        }
        results: dict[str, dict[str, object]] = {}
        for name, (recipe, env) in ways.items():
            runs = [_measure(recipe, args.examples, env) for _ in range(args.repeats)]
            walls = [r[0] for r in runs]
            results[name] = {"recipe": recipe, "checks": runs[0][2], "failed": runs[0][3],
                             "wall_median_s": round(statistics.median(walls), 2),
                             "wall_range_s": [round(min(walls), 2), round(max(walls), 2)]}
            print(f"{name}: {results[name]['wall_median_s']} s median of {args.repeats} ({runs[0][2]} checks, "
                  f"{runs[0][3]} failed)", flush=True)
        heavy_pre = results["heavy-import recipe, module preloaded"]["wall_median_s"]
        heavy_per = results["heavy-import recipe, imported per launch"]["wall_median_s"]
        payload = {
            "command": "python benchmarks/battery_bench.py",
            "what": "wall time of the whole battery for one recipe (every plan case at W=1-4 in fp32 and fp64, and "
                    f"{args.examples} drawn layouts), each in a fresh process",
            "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                        "torch": __import__("torch").__version__},
            "date": time.strftime("%Y-%m-%d"),
            "repeats": args.repeats,
            "results": results,
            "ratio_per_launch_over_preloaded": round(float(heavy_per) / float(heavy_pre), 2),  # type: ignore[arg-type]
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"ratio (imported per launch / preloaded): {payload['ratio_per_launch_over_preloaded']}; "
              f"written to {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
