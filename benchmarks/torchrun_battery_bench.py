"""The battery at W=4 two ways, side by side: in-process (the launcher's forkserver, one machine) and inside torchrun as
two agents of two workers each (c10d rendezvous on 127.0.0.1, gloo), on the correct recipe; and the time per check
at W=8 in-process.

    python benchmarks/torchrun_battery_bench.py [--repeats 3] [--precision fp32]
        [--out benchmarks/results/torchrun_battery.json]

In-process: every case of the plan at W=4 through ``harness.battery.report.table.run_cases`` in this process (the
forkserver started first, not timed), cache cleared between repeats. torchrun: the job's wall time from starting the
two agents to both exiting (rendezvous included) and the battery's own time as rank 0 prints it. Not a test:
nothing here fails on a number.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, command, machine, now, write_result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "fp64", "both"))
    parser.add_argument("--out", default=str(RESULTS / "torchrun_battery.json"))
    args = parser.parse_args()
    from support.battery_jobs import job

    from harness.battery.launch import runner
    from harness.battery.plan import cases as plan
    from harness.battery.plan.options import BatteryOptions
    from harness.battery.prepare import steps as prepare
    from harness.battery.report.table import run_cases
    from harness.distributed.launcher import launch
    from harness.distributed.probes import all_reduce_rank
    from harness.recipes import CORRECT_RECIPE

    def in_process(world: int) -> tuple[int, list[float]]:
        """The plan's cases at ``world`` through the in-process launcher, each repeat from a cleared run cache."""
        options = BatteryOptions.parse(precision=args.precision, world_sizes=[world], examples=0)
        cases = plan.session_cases(options)
        times = []
        for _ in range(args.repeats):
            runner._CACHE.clear()
            prepare._CHAINS.clear()
            t = time.perf_counter()
            verdicts = run_cases(CORRECT_RECIPE, cases, options)
            times.append(time.perf_counter() - t)
            assert all(v.passed for v in verdicts), [v.message for v in verdicts if not v.passed]
        return len(cases), times

    launch(all_reduce_rank, 4)  # the forkserver's start: not part of any figure
    n_cases, inproc = in_process(4)
    n_wide, inproc8 = in_process(8)
    job_s, battery_s = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            codes, text, report = job(Path(tmp), "--recipe", CORRECT_RECIPE, "--precision", args.precision)
            job_s.append(time.perf_counter() - t)
        assert codes == [0, 0] and report is not None, text[-2000:]
        found = re.search(r"checks at W=4 under torchrun in ([\d.]+) s", text)
        battery_s.append(float(found.group(1)) if found else float("nan"))
    result = {
        "schema": "harness.torchrun-battery/1",
        "command": command("benchmarks/torchrun_battery_bench.py"),
        "machine": machine(),
        "date": now(),
        "checks": n_cases,
        "precision": args.precision,
        "in_process_w4_s": {"median": round(statistics.median(inproc), 2), "runs": [round(x, 2) for x in inproc]},
        "torchrun_2x2_job_s": {"median": round(statistics.median(job_s), 2), "runs": [round(x, 2) for x in job_s]},
        "torchrun_2x2_battery_s": {"median": round(statistics.median(battery_s), 2),
                                   "runs": [round(x, 2) for x in battery_s]},
        "per_check_in_process_ms": round(1000 * statistics.median(inproc) / n_cases, 1),
        "per_check_torchrun_ms": round(1000 * statistics.median(battery_s) / n_cases, 1),
        "checks_w8": n_wide,
        "in_process_w8_s": {"median": round(statistics.median(inproc8), 2), "runs": [round(x, 2) for x in inproc8]},
        "per_check_in_process_w8_ms": round(1000 * statistics.median(inproc8) / n_wide, 1),
    }
    print(write_result(args.out, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
