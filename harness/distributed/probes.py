"""Small rank bodies for :func:`harness.distributed.launcher.launch`: the launcher's own tests, its benchmark and
``check-environment --dual`` use them. They live in the package (not in ``tests/``) so the forkserver has them
preloaded and a warm launch imports nothing.
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


def all_reduce_rank() -> int:
    """Every rank contributes ``rank + 1``; returns the sum (``W (W + 1) / 2`` on every rank)."""
    t = torch.tensor(dist.get_rank() + 1)
    dist.all_reduce(t)
    return int(t)


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
