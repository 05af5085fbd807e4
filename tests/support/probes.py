"""Rank bodies for :func:`harness.distributed.launcher.launch` that only the tests and the benchmarks use: who a rank
is (:func:`identity`), one DDP step (:func:`ddp_step`, timed by ``benchmarks/launch_bench.py``), and a rank that
raises, dies, skips a collective or sleeps (the launcher's tests, ``benchmarks/reliability.py``).

Ranks import this module as ``support.probes`` (``tests/`` on ``sys.path``); a caller that times warm launches passes
``preload=("support.probes",)`` so the forkserver imports it once. The probe the product runs
(``check-environment --dual``) is :func:`harness.distributed.probes.all_reduce_rank`.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def identity(value: Any) -> dict[str, Any]:
    """Return who this rank is, and ``value``."""
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "pid": os.getpid(), "value": value}


def ddp_step(size: int = 64) -> float:
    """One DDP forward/backward of a ``size x size`` linear layer; returns the gradient's sum."""
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(size, size))
    model(torch.ones(4, size) * (dist.get_rank() + 1)).sum().backward()
    value = float(sum(p.grad.sum() for p in model.parameters() if p.grad is not None))
    del model
    return value


def raise_on(rank: int, exc_type: str = "RuntimeError", message: str = "probe failure") -> str:
    """Rank ``rank`` raises ``exc_type(message)``; the others enter an all-reduce that it never joins."""
    if dist.get_rank() == rank:
        raise {"RuntimeError": RuntimeError, "ValueError": ValueError}[exc_type](message)
    dist.all_reduce(torch.zeros(1))
    return "unreachable"


def kill_self_on(rank: int, sig: int = signal.SIGKILL) -> str:
    """Rank ``rank`` sends itself ``sig``; the others wait in an all-reduce."""
    if dist.get_rank() == rank:
        os.kill(os.getpid(), sig)
        time.sleep(30)
    dist.all_reduce(torch.zeros(1))
    return "unreachable"


def skip_collective_on(rank: int) -> str:
    """Rank ``rank`` returns without the all-reduce its peers enter: they block until the process-group timeout."""
    if dist.get_rank() != rank:
        dist.all_reduce(torch.zeros(3))
    return "returned"


def sleep_on(rank: int | None, seconds: float = 3600.0, pid_file: str | None = None) -> str:
    """Rank ``rank`` (every rank for None) sleeps outside any collective; each rank first writes its pid to
    ``pid_file.<rank>``."""
    if pid_file:
        with open(f"{pid_file}.{dist.get_rank()}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(f"{pid_file}.{dist.get_rank()}.tmp", f"{pid_file}.{dist.get_rank()}")
    if rank is None or dist.get_rank() == rank:
        time.sleep(seconds)
    return "awake"


__all__ = ["ddp_step", "identity", "kill_self_on", "raise_on", "skip_collective_on", "sleep_on"]
