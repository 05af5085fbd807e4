"""A bf16 training step as users write it, torch only: the forward under ``torch.autocast``, the loss summed in float32
over the all-reduced count, for DDP and FSDP2 alike (each strategy's own way of skipping a synchronization)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100


def _skip_sync(model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager[Any]:
    """DDP's ``no_sync()`` for all but the last microbatch; FSDP2's ``set_requires_gradient_sync``, set per pass."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else model.no_sync()  # type: ignore[operator]


class AutocastStep:
    """Enters ``torch.autocast("cpu", dtype=torch.bfloat16)`` itself around the forward, as bf16 loops do."""

    name = "autocast_step"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()
        count = torch.tensor([sum(int((mb.labels != IGNORE).sum()) for mb in window)])
        dist.all_reduce(count)
        total = int(count)
        if total == 0:
            raise ValueError("no supervised token in this window on any rank")
        for i, mb in enumerate(window):
            with _skip_sync(model, i == len(window) - 1):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(mb.inputs)
                s = F.cross_entropy(logits.float().flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE,
                                    reduction="sum")
                (s * world / total).backward()
