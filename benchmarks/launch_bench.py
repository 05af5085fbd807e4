"""Warm launcher vs a fresh ``spawn`` per launch, for one 2-rank gloo DDP step.

    python benchmarks/launch_bench.py [--warm 20] [--spawn 3]

Prints the median wall time per launch of each way and their ratio, measured in the same run (the machine is shared
and noisy: read the ratio, not the absolute figures). Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.dist import probes
from harness.dist.launcher import launch


def _spawn_rank(rank: int, world: int, store_dir: str, out: object) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    value = probes.ddp_step()
    out.put((rank, value))  # type: ignore[attr-defined]
    dist.barrier()
    os._exit(0)


def spawn_once(world: int = 2) -> list[float]:
    """One launch the plain way: a fresh interpreter per rank (imports torch, then DDP imports torch._dynamo)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_spawn_rank, args=(r, world, d, q)) for r in range(world)]
        for p in procs:
            p.start()
        results = dict(q.get() for _ in range(world))
        for p in procs:
            p.join(60)
    return [results[r] for r in range(world)]


def timed(fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=20, help="warm launches to time (after one to start the server)")
    parser.add_argument("--spawn", type=int, default=3, help="spawn-per-launch runs to time")
    args = parser.parse_args()

    first = timed(lambda: launch(probes.ddp_step, 2), 1)[0]
    warm = timed(lambda: launch(probes.ddp_step, 2), args.warm)
    spawn = timed(spawn_once, args.spawn)
    w, s = statistics.median(warm), statistics.median(spawn)
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}")
    print(f"first launch (starts the forkserver, imports torch once): {first:.3f} s")
    print(f"warm launch, 2-rank gloo DDP step, median of {args.warm}: {w:.3f} s "
          f"(min {min(warm):.3f}, max {max(warm):.3f})")
    print(f"spawn per launch, same step, median of {args.spawn}: {s:.3f} s "
          f"(min {min(spawn):.3f}, max {max(spawn):.3f})")
    print(f"ratio spawn / warm: {s / w:.1f}x")


if __name__ == "__main__":
    main()
