"""Time seed 000's trio (stop at 50, continuous to 100, resume 50 -> 100) through the launcher, and check its verdict.

    python benchmarks/resume_trio.py [--config configs/minimum.yaml] [--repeat 3] [--out FILE]

Prints the wall time of each run and of the trio (target on a 2-core machine: under 60 s), then the largest difference
between the resumed and the continuous state at the last step (must be exactly 0.0). The first launch also starts the
launcher's forkserver (imports); it is timed separately, so the trio measures training, not start-up. Writes every
trio's times, the medians (of the trio and of each run) and the differences as JSON; exit 1 when a resumed run does not
land on the continuous run's bits. ``--out`` defaults to ``benchmarks/results/resume_trio.json``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, ROOT, command, machine, now, write_result

from harness.data.config import load_config
from harness.distributed.launcher import launch
from harness.distributed.probes import all_reduce_rank
from harness.training.trainer import launched_run, state_difference


def trio(config_path: Path, deadline: float) -> tuple[dict[str, float], float]:
    config = load_config(config_path)
    work = Path(tempfile.mkdtemp(prefix="resume-trio-"))
    try:
        times = {}
        t = time.perf_counter()
        launch(launched_run, config.world_size, config, str(work / "stopped"), {"stop_at": config.stop_at},
               deadline=deadline)
        times["stop"] = time.perf_counter() - t
        t = time.perf_counter()
        control = launch(launched_run, config.world_size, config, str(work / "continuous"), {}, deadline=deadline)
        times["continuous"] = time.perf_counter() - t
        t = time.perf_counter()
        step_dir = work / "stopped" / f"step-{config.stop_at:04d}"
        resumed = launch(launched_run, config.world_size, config, str(work / "resumed"), {"resume": str(step_dir)},
                         deadline=deadline)
        times["resume"] = time.perf_counter() - t
        worst = max(state_difference(a["state"], b["state"]) for a, b in zip(control, resumed))
        return times, worst
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _shown(path: Path) -> str:
    """``path`` relative to the checkout where it lies inside it (no machine's absolute path in a result file)."""
    full = path.resolve()
    return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else str(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "minimum.yaml")
    p.add_argument("--repeat", type=int, default=3, help="trios to time; the median is reported")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds each launch may take")
    p.add_argument("--out", default=str(RESULTS / "resume_trio.json"))
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat={args.repeat} must be at least 1")
    t = time.perf_counter()
    launch(all_reduce_rank, 2, deadline=args.deadline)
    start = time.perf_counter() - t
    print(f"forkserver start (first launch, not part of the trio): {start:.2f} s")
    trios = []
    for i in range(args.repeat):
        times, worst = trio(args.config, args.deadline)
        total = sum(times.values())
        trios.append({**{k: round(v, 3) for k, v in times.items()}, "total": round(total, 3),
                      "max_abs_difference": worst})
        parts = "  ".join(f"{k} {v:.2f} s" for k, v in times.items())
        print(f"trio {i + 1}: {parts}  total {total:.2f} s  max |resumed - continuous| at the end = {worst!r}")
    equal = sum(t["max_abs_difference"] == 0.0 for t in trios)
    result = {
        "command": command("benchmarks/resume_trio.py"),
        "what": "wall time of seed 000's trio through the launcher: stop at 50, continuous to 100, resume 50 -> 100 "
        "(W=2, gloo), after one launch that starts the forkserver",
        "config": _shown(args.config),
        "machine": machine(),
        "date": now(),
        "forkserver_start_s": round(start, 3),
        "repeats": args.repeat,
        "median_trio_s": round(statistics.median(t["total"] for t in trios), 2),
        "median_run_s": {k: round(statistics.median(t[k] for t in trios), 2) for k in ("stop", "continuous", "resume")},
        "bitwise_equal": equal,
        "trios": trios,
    }
    write_result(args.out, result)
    print(f"median trio: {result['median_trio_s']:.2f} s over {len(trios)} trio(s) (target < 60 s on 2 cores), "
          f"{equal}/{len(trios)} bitwise equal; wrote {args.out}")
    if equal != len(trios):
        print("FAIL: the resumed run does not land on the continuous run's bits", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
