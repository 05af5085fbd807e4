"""Rank bodies for ``test_launcher.py`` that :mod:`harness.dist.probes` does not have: lockstep progress, the
environment a rank sees, and an argument that makes one rank late to start.

Imported by plain name: the tests put this folder on ``sys.path``, which each rank inherits from the caller.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from harness.dist.launcher import progress


def lockstep(steps: int) -> list[int]:
    """Every rank all-reduces ``rank + step`` at each step and reports the step; returns the sums."""
    sums = []
    for step in range(steps):
        t = torch.tensor(dist.get_rank() + step)
        dist.all_reduce(t)
        sums.append(int(t))
        progress(step, f"window {step}: all-reduced {int(t)}")
    return sums


def refuse_on(rank: int, at: int, steps: int) -> str:
    """Like :func:`lockstep`, but rank ``rank`` refuses step ``at`` (as a recipe refuses an empty window), reports it,
    and returns, while its peers enter that step's all-reduce."""
    for step in range(steps):
        if dist.get_rank() == rank and step == at:
            progress(step, f"window {step}: refused the window: ValueError: no supervised token")
            return "refused"
        dist.all_reduce(torch.ones(1))
        progress(step, f"window {step}")
    return "done"


def tick(steps: int | None, pause: float) -> int:
    """Report ``steps`` steps (forever for None), ``pause`` seconds apart, with no collective."""
    step = 0
    while steps is None or step < steps:
        progress(step)
        if pause:
            time.sleep(pause)
        step += 1
    return step


def environment() -> dict[str, Any]:
    """This rank's environment, and the names in the environment its forkserver started with."""
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:
        server = [entry.split(b"=", 1)[0].decode(errors="replace") for entry in f.read().split(b"\0") if entry]
    return {"environ": dict(os.environ), "server": server}


def _arrive(rank: int, delay: float) -> str:
    # RANK is already the launched rank's: the launcher applies each rank's environment before unpickling arguments.
    if os.environ.get("RANK") == str(rank):
        time.sleep(delay)
        return "late"
    return "on time"


class LateArrival:
    """An argument that, as the ranks unpickle it, makes rank ``rank`` sleep ``delay`` seconds before it starts: a
    rank late to the rendezvous, as on a loaded machine."""

    def __init__(self, rank: int, delay: float) -> None:
        self.rank = rank
        self.delay = delay

    def __reduce__(self) -> tuple[Any, ...]:
        return (_arrive, (self.rank, self.delay))


def late_then_refuse(late: str, rank: int, at: int, steps: int) -> str:
    """:func:`refuse_on` after a start delayed by ``late`` (a :class:`LateArrival`, applied at unpickling)."""
    return refuse_on(rank, at, steps)
