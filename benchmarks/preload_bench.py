"""A rank function in a module with a slow import, launched at W=2 with and without ``launch(..., preload=...)``.

    python benchmarks/preload_bench.py [--launches 10] [--sleep 0.5] [--out benchmarks/results/preload.json]

Two such modules, generated in a temporary folder: one that sleeps ``--sleep`` seconds at import (a stand-in with a
known cost), and one that imports ``matplotlib.pyplot`` (a real, heavy package of this environment). For each, it
times ``--launches`` launches without preload (each rank imports the module as it unpickles its function), then one
launch that restarts the forkserver with the module preloaded (timed on its own), then ``--launches`` launches with
it preloaded. Writes the medians per launch and their ratio as JSON and prints it. The machine is shared and noisy:
read the ratio, not the absolute figures. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import RESULTS, command, machine, now, timed, write_result

from harness.distributed.launcher import launch
from harness.distributed.probes import all_reduce_rank

_BODY = '''

import torch.distributed as dist


def body():
    return dist.get_rank()
'''

MODULES = {
    "sleep": "import time\n\ntime.sleep({sleep})\n" + _BODY,
    "matplotlib.pyplot": "import matplotlib\n\nmatplotlib.use('Agg')\nimport matplotlib.pyplot\n" + _BODY,
}


def measure(name: str, launches: int) -> dict[str, Any]:
    """Time one generated module's launches without, then with, preload (the parent imports it first, once)."""
    module = importlib.import_module(name)
    without = timed(lambda: launch(module.body, 2), launches)
    restart = timed(lambda: launch(module.body, 2, preload=(name,)), 1)[0]
    with_preload = timed(lambda: launch(module.body, 2, preload=(name,)), launches)
    a, b = statistics.median(without), statistics.median(with_preload)
    return {
        "without_preload_median_s": round(a, 4),
        "without_preload_range_s": [round(min(without), 4), round(max(without), 4)],
        "with_preload_median_s": round(b, 4),
        "with_preload_range_s": [round(min(with_preload), 4), round(max(with_preload), 4)],
        "ratio_without_over_with": round(a / b, 2),
        "server_restart_launch_s": round(restart, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=10, help="launches to time in each way, per module")
    parser.add_argument("--sleep", type=float, default=0.5, help="seconds the stand-in module sleeps at import")
    parser.add_argument("--out", default=str(RESULTS / "preload.json"))
    args = parser.parse_args()

    tag = f"{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="preload-bench-") as folder:
        names = {}
        for case, source in MODULES.items():
            name = f"bench_{case.replace('.', '_')}_{tag}"
            Path(folder, f"{name}.py").write_text(source.format(sleep=args.sleep))
            names[case] = name
        sys.path.insert(0, folder)
        launch(all_reduce_rank, 2)  # start the forkserver: not part of any figure
        cases = {case: measure(name, args.launches) for case, name in names.items()}

    result = {
        "command": command("benchmarks/preload_bench.py"),
        "what": "wall time per launch of a 2-rank gloo run whose function lives in a module with a slow import",
        "world_size": 2,
        "launches_per_way": args.launches,
        "sleep_module_import_s": args.sleep,
        "machine": machine(),
        "date": now(),
        "cases": cases,
    }
    print(write_result(args.out, result))


if __name__ == "__main__":
    main()
