"""A clipping step (DDP) written the way users write one, torch only, whose clipping is right and whose returned norm
is not: it reports the sum of the per-parameter norms (a logging line that adds them up) instead of the global L2
norm ``clip_grad_norm_`` clipped by. Parity cannot see it (the gradient is clipped correctly); only the clipping
check, which compares the returned norm with the reference's, can."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100


def _logits(out: Any) -> torch.Tensor:
    """A user's model may return an output object with ``.logits`` (``--model``)."""
    return out if isinstance(out, torch.Tensor) else out.logits


class SumOfTensorNorms:
    """Right gradient, right clipping; returns ``sum(p.grad.norm())`` as the norm."""

    name = "sum_of_tensor_norms"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any],
                        max_norm: float = 1.0) -> tuple[float, float]:
        world = dist.get_world_size()
        count = torch.tensor([sum(int((mb.labels != IGNORE).sum()) for mb in window)])
        dist.all_reduce(count)
        total = int(count)
        if total == 0:
            raise ValueError("no supervised token in this window on any rank")
        local = 0.0
        for i, mb in enumerate(window):
            with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():  # type: ignore[operator]
                s = F.cross_entropy(_logits(model(mb.inputs)).flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE,
                                    reduction="sum")
                (s * world / total).backward()
            local += float(s.detach())
        reported = sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        logged = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(logged)
        return float(logged) / total, reported
