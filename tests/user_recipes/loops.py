"""Training steps written the way users write them (torch only), each with one habit the contract forbids or the
float32 lane cannot judge: bf16 autocast, a communication hook of their own, weight decay inside the step."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

IGNORE = -100


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _step(model: torch.nn.Module, window: Sequence[Any], *, autocast: bool = False, decay: float = 0.0) -> None:
    world = dist.get_world_size()
    count = torch.tensor([sum(int((mb.labels != IGNORE).sum()) for mb in window)])
    dist.all_reduce(count)
    total = int(count)
    if total == 0:
        raise ValueError("no supervised token in this window on any rank")
    for i, mb in enumerate(window):
        last = i == len(window) - 1
        with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
            amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with amp:
                logits = _logits(model(mb.inputs))
            s = F.cross_entropy(logits.float().flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE,
                                reduction="sum")
            (s * world / total).backward()
    if decay:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 - decay)
    return None


class BF16Autocast:
    """The forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``, the loss upcast to float32: right in bf16,
    wrong at float32's tolerances, and invisible to a float64 run (CPU autocast leaves float64 alone)."""

    name = "bf16_autocast"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        _step(model, window, autocast=True)


class OwnCommHook:
    """Registers DDP's fp16 compression hook in ``setup()``, as a user copying a tuning guide would: the harness owns
    the model's one hook, so this is a usage error, not a verdict."""

    name = "own_comm_hook"

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        if self.model is None:
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)  # type: ignore[operator]
            self.model = model
        _step(model, window)


class DecayInTheStep:
    """Decoupled weight decay written into the step after the last backward (``p.mul_(1 - lr * wd)``)."""

    name = "decay_in_the_step"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        _step(model, window, decay=1e-3)
