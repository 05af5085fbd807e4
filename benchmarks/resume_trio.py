"""Time seed 000's trio (stop at 50, continuous to 100, resume 50 -> 100) through the launcher, and check its verdict.

    python benchmarks/resume_trio.py [--config configs/minimum.yaml] [--repeat 3]

Prints the wall time of each run and of the trio (target on a 2-core machine: under 60 s), then the largest difference
between the resumed and the continuous state at the last step (must be exactly 0.0). The first launch also starts the
launcher's forkserver (a few seconds of imports); it is timed separately, so the trio measures training, not start-up.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.data.config import load_config  # noqa: E402 (the checkout must be importable without installing it)
from harness.dist.launcher import launch  # noqa: E402
from harness.dist.probes import identity  # noqa: E402
from harness.training.trainer import launched_run, state_difference  # noqa: E402


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "minimum.yaml")
    p.add_argument("--repeat", type=int, default=3, help="trios to time; the median is reported")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds each launch may take")
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat={args.repeat} must be at least 1")
    t = time.perf_counter()
    launch(identity, 2, None, deadline=args.deadline)
    print(f"forkserver start (first launch, not part of the trio): {time.perf_counter() - t:.2f} s")
    totals = []
    for i in range(args.repeat):
        times, worst = trio(args.config, args.deadline)
        total = sum(times.values())
        totals.append(total)
        parts = "  ".join(f"{k} {v:.2f} s" for k, v in times.items())
        print(f"trio {i + 1}: {parts}  total {total:.2f} s  max |resumed - continuous| at the end = {worst!r}")
        if worst != 0.0:
            print("FAIL: the resumed run does not land on the continuous run's bits", file=sys.stderr)
            return 1
    totals.sort()
    print(f"median trio: {totals[len(totals) // 2]:.2f} s over {len(totals)} trio(s) (target < 60 s on 2 cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
