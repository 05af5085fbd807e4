"""The report's CPU scaling table: the same training workload at each world size, and seed 003's scaling efficiency
``throughput_W / (W * throughput_1)``. CPU figures of this machine, not a GPU prediction.

``timed_training`` is a rank body: module-level so that :func:`harness.distributed.launcher.launch` can run it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness.data.batching import collate
from harness.data.config import Config
from harness.data.corpus import make_corpus
from harness.data.plan import make_plan
from harness.distributed.launcher import launch
from harness.model import build_model
from harness.workflow.outputs import Progress, silent
from harness.workflow.protocol import DEADLINE

SCALING_WORLDS = (1, 2, 4)
SCALING_STEPS = 20
"""Timed optimizer steps per world size (a setting, ``report --scaling-steps``): enough to dwarf the launch, few
enough to keep the report quick."""
SCALING_WARMUP = 2
"""Untimed steps first: DDP rebuilds its buckets after the first iteration, and the first pass pays lazy imports."""


def timed_training(config: Config, steps: int, warmup: int) -> dict[str, float]:
    """Rank body: ``warmup`` untimed then ``steps`` timed optimizer steps of the correct recipe; global tokens/s."""
    from harness.core.loss import global_count
    from harness.distributed import strategies
    from harness.recipes import global_token_mean

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = make_corpus(config)
    plan = make_plan(rows, config, world_size=world, steps=warmup + steps)
    model = build_model(config, dropout=0.0)
    ddp = strategies.get("ddp").wrap(model, torch.device("cpu"), count_syncs=False).module
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=config.momentum)
    tokens, start = 0, 0.0
    for index in range(warmup + steps):
        if index == warmup:
            dist.barrier()  # every rank starts the clock together
            start = time.perf_counter()
        window = [collate([rows[i] for i in ids]) for ids in plan[index][rank]]
        if index >= warmup:
            tokens += sum(mb.supervised for mb in window)
        ddp.zero_grad(set_to_none=True)
        global_token_mean.backward_window(ddp, window)
        optimizer.step()
    dist.barrier()  # the slowest rank sets the pace of a synchronous step
    elapsed = time.perf_counter() - start
    total = global_count(tokens)
    del ddp
    return {"tokens": float(total), "seconds": elapsed}


def check_worlds(config: Config, worlds: Sequence[int]) -> None:
    """A world size the corpus cannot feed is refused (ValueError from the plan) before anything runs."""
    rows = make_corpus(config)
    for w in worlds:
        make_plan(rows, config, world_size=w, steps=1)


def scaling(config: Config, worlds: Sequence[int] = SCALING_WORLDS, steps: int = SCALING_STEPS,
            progress: Progress = silent) -> list[dict[str, Any]]:
    """Seed 003's scaling efficiency ``throughput_W / (W * throughput_1)`` at each world size, on this CPU."""
    check_worlds(config, worlds)
    rows = []
    for w in worlds:
        progress(f"  scaling: {steps} steps on {w} rank(s)")
        (result, *_) = launch(timed_training, w, config, steps, SCALING_WARMUP, deadline=DEADLINE)
        rows.append({"world_size": w, "steps": steps, "tokens": int(result["tokens"]), "seconds": result["seconds"],
                     "tokens_per_s": result["tokens"] / result["seconds"]})
    base = next((r["tokens_per_s"] for r in rows if r["world_size"] == 1), None)
    for r in rows:
        r["efficiency"] = None if base is None else r["tokens_per_s"] / (r["world_size"] * base)
    return rows


def cpu_label() -> str:
    import platform

    return f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), gloo, 1 thread per rank"
