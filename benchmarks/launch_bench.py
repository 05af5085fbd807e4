"""Warm launcher vs a fresh ``spawn`` per launch, for one 2-rank gloo DDP step.

    python benchmarks/launch_bench.py [--warm 20] [--spawn 3] [--out benchmarks/results/launch.json]

Times the first launch (it starts the forkserver, which imports torch once, and with ``preload=`` the step's module
``support.probes``, ``tests/support/probes.py``), then ``--warm`` launches through the warm forkserver (which import
nothing), then ``--spawn`` launches of the same step the plain way (a fresh interpreter per rank). Writes the median
wall time per launch of each way, their ranges and their ratio, measured in the same run, as JSON and prints it. The
machine is shared and noisy: read the ratio, not the absolute figures. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile

from _common import RESULTS, command, machine, now, summary, timed, write_result
from support import probes

from harness.distributed.launcher import launch

PRELOAD = (probes.__name__,)
"""The step's module (``tests/support/probes.py``), imported once by the forkserver: a warm launch imports nothing."""


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=20, help="warm launches to time (after one to start the server)")
    parser.add_argument("--spawn", type=int, default=3, help="spawn-per-launch runs to time")
    parser.add_argument("--out", default=str(RESULTS / "launch.json"))
    args = parser.parse_args()

    first = timed(lambda: launch(probes.ddp_step, 2, preload=PRELOAD), 1)[0]
    warm = timed(lambda: launch(probes.ddp_step, 2, preload=PRELOAD), args.warm)
    spawn = timed(spawn_once, args.spawn)
    result = {
        "command": command("benchmarks/launch_bench.py"),
        "what": "wall time per launch of one 2-rank gloo DDP step (support.probes.ddp_step, tests/support/probes.py): "
        "through the launcher's warm forkserver (the step's module preloaded), and with a fresh spawn of each rank",
        "world_size": 2,
        "machine": machine(),
        "date": now(),
        "first_launch_s": round(first, 3),
        "warm": summary(warm),
        "spawn": summary(spawn, 3),
        "ratio_spawn_over_warm": round(statistics.median(spawn) / statistics.median(warm), 1),
    }
    print(write_result(args.out, result))


if __name__ == "__main__":
    main()
