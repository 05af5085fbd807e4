"""Time the resume battery on the harness's own trainer (every case, defaults), and check its verdict.

    python benchmarks/resume_bench.py [--trainer PKG.MODULE:FACTORY] [--repeat 3] [--out FILE]

One launch first starts the launcher's forkserver (timed apart); then each repeat runs the whole battery (two
continuous runs, a drawn stop, a resume, a resume of the resume, four kills and their resumes) and its wall time is
recorded. The README's figure is ``median_battery_s`` (target on a 2-core machine: under 60 s). Exit 1 when a case
fails. ``--out`` defaults to ``benchmarks/results/resume_battery.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import RESULTS, command, machine, now, write_result

from harness.distributed.launcher import launch
from harness.distributed.probes import all_reduce_rank
from harness.resume.battery import run_battery
from harness.resume.contract import HARNESS_TRAINER
from harness.resume.options import ResumeOptions


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", default=HARNESS_TRAINER)
    p.add_argument("--repeat", type=int, default=3, help="batteries to time; the median is reported")
    p.add_argument("--out", default=str(RESULTS / "resume_battery.json"))
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat={args.repeat} must be at least 1")
    t = time.perf_counter()
    launch(all_reduce_rank, 2, deadline=120.0)
    start = time.perf_counter() - t
    print(f"forkserver start (first launch, not part of the battery): {start:.2f} s")
    runs = []
    for i in range(args.repeat):
        report = run_battery(args.trainer, ResumeOptions())
        runs.append({"seconds": round(report.seconds, 3), "passed": report.passed,
                     "cases": {r.case: r.status for r in report.results}})
        print(f"battery {i + 1}: {report.seconds:.2f} s, {'every case passed' if report.passed else 'FAILED'}")
    options = ResumeOptions()
    result = {
        "command": command("benchmarks/resume_bench.py"),
        "what": "wall time of the whole resume battery (every case, default options: S=20, a checkpoint every 5, "
                "W=2, gloo, CPU) on one trainer, after one launch that starts the forkserver",
        "trainer": args.trainer,
        "steps": options.steps, "every": options.every, "world_size": options.world_size,
        "machine": machine(),
        "date": now(),
        "forkserver_start_s": round(start, 3),
        "repeats": args.repeat,
        "median_battery_s": round(statistics.median(r["seconds"] for r in runs), 1),
        "all_passed": all(r["passed"] for r in runs),
        "runs": runs,
    }
    write_result(args.out, result)
    print(f"median battery: {result['median_battery_s']} s over {len(runs)} run(s) (target < 60 s on 2 cores); "
          f"wrote {args.out}")
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
