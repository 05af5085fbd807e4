"""Rank bodies for ``test_launcher.py`` that ``support.probes`` (``tests/support/probes.py``) does not have: lockstep
progress, the environment a rank sees, and an argument that makes one rank late to start.

Imported by plain name: the tests put this folder on ``sys.path``, which each rank inherits from the caller.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from harness.distributed.launcher import progress


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


def ddp_steps(factory: str, steps: int, find_unused_parameters: bool = False) -> str:
    """``steps`` forward and backward passes of the ``user_recipes.models`` model ``factory`` under DDP (a token
    cross-entropy on random tokens): what a training loop does before DDP's own errors show."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from user_recipes import models

    torch.manual_seed(0)
    model = DDP(getattr(models, factory)(), find_unused_parameters=find_unused_parameters)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        tokens = torch.randint(1, models.VOCAB, (2, 6), generator=gen)
        out = model(tokens)
        logits = out.logits if hasattr(out, "logits") else out
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return "done"


def warn(message: str) -> int:
    """``warnings.warn(message)`` on every rank, as a deprecated call in a recipe does."""
    import warnings

    warnings.warn(message, UserWarning, stacklevel=1)
    return dist.get_rank()


def write_fd(fd: int, text: str) -> int:
    """Write ``text`` straight to file descriptor ``fd``, below Python's streams, as C++ code (gloo) does; rank 1
    adds a line of its own."""
    os.write(fd, text.encode())
    if dist.get_rank() == 1:
        os.write(fd, b"only rank 1 says this\n")
    return dist.get_rank()


def print_then_raise(text: str) -> None:
    """Every rank prints ``text``; then rank 1 raises."""
    print(text)
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gave up after printing")
    dist.barrier()


def mismatched_all_reduce() -> int:
    """Rank 0 all-reduces 3 numbers, rank 1 five: gloo aborts a rank with "collective mismatch" on its stderr."""
    t = torch.ones(3 if dist.get_rank() == 0 else 5)
    dist.all_reduce(t)
    return int(t.sum())


def report_inside_then_mismatch(skipper: int, counted: bool) -> int:
    """Every rank reports from inside step 0, then the all-reduce of ``mismatched_all_reduce`` (gloo aborts a rank).
    ``skipper`` says it skipped the backward that begins the gradient all-reduce (``counted``), or that its step ended
    in its own exception (no count); its peers that they began the all-reduce."""
    if dist.get_rank() == skipper:
        note = ("skipped the backward of window 0 (microbatch 1): its DDP all-reduce never ran" if counted else
                "raised KeyError in window 0")
        progress(0, note, collectives=0 if counted else None, finished=False)
    else:
        progress(0, "ran the backward of window 0 (microbatch 1), which began the DDP all-reduce", collectives=1,
                 finished=False)
    t = torch.ones(3 if dist.get_rank() == skipper else 5)
    dist.all_reduce(t)
    return int(t.sum())
