"""Clipping mistakes written as users write them (plain PyTorch, none of the harness's helpers): each tensor clipped
alone, squared norms all-reduced again after the synchronization, a clip before the division by the count, a clip by
a sum of per-tensor norms. Each clips (``max_norm``) and returns ``(loss, norm)``; the clipping check and the
diagnosis must name what each one did (``tests/distributed/test_clipping.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _global_tokens(window: Sequence[Any]) -> float:
    n = torch.tensor(float(sum(int((mb.labels != -100).sum()) for mb in window)))
    dist.all_reduce(n)
    if n.item() == 0:
        raise ValueError("no supervised token in this window")
    return float(n.item())


def _backward(model: torch.nn.Module, window: Sequence[Any], scale: float) -> float:
    """Every microbatch's loss sum times ``scale``, all but the last inside ``no_sync()``; the local loss sum."""
    total = 0.0
    for i, mb in enumerate(window):
        ctx = model.no_sync() if i < len(window) - 1 else contextlib.nullcontext()  # type: ignore[operator]
        with ctx:
            logits = model(mb.inputs)
            s = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=-100, reduction="sum")
            (s * scale).backward()
        total += float(s.detach())
    return total


class PerTensorClip:
    """``clip_grad_norm_`` on each tensor alone, in a loop, adding up what it returns: no tensor reaches max_norm, so
    the clip never engages, and the norm is a sum of per-tensor norms."""

    name = "per_tensor_clip"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any], max_norm: float = 1.0
                        ) -> tuple[float, float]:
        n, w = _global_tokens(window), dist.get_world_size()
        loss = _backward(model, window, w / n)
        norm = 0.0
        for p in model.parameters():
            if p.grad is not None:
                norm += float(torch.nn.utils.clip_grad_norm_([p], max_norm))
        return loss / n, norm


class NormReducedAgain:
    """The squared norm all-reduced over the ranks after DDP has synchronized: every rank holds the same gradient,
    so the norm is sqrt(W) too large and the clip too strong."""

    name = "norm_reduced_again"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any], max_norm: float = 1.0
                        ) -> tuple[float, float]:
        n, w = _global_tokens(window), dist.get_world_size()
        loss = _backward(model, window, w / n)
        sq = torch.stack([p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None]).sum()
        dist.all_reduce(sq)
        norm = sq.sqrt()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return loss / n, float(norm)


class ClipBeforeScale:
    """Backpropagates the loss sum, clips, and only then divides by the token count: the norm is N/W times the
    right one, and the clipped gradient N/W times too small."""

    name = "clip_before_scale"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any], max_norm: float = 1.0
                        ) -> tuple[float, float]:
        n, w = _global_tokens(window), dist.get_world_size()
        loss = _backward(model, window, 1.0)
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(w / n)
        return loss / n, float(norm)


class SumOfTensorNorms:
    """Clips every tensor by one factor, computed from the sum of the per-tensor norms instead of the global L2."""

    name = "sum_of_tensor_norms"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any], max_norm: float = 1.0
                        ) -> tuple[float, float]:
        n, w = _global_tokens(window), dist.get_world_size()
        loss = _backward(model, window, w / n)
        norm = sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(min(1.0, max_norm / (norm + 1e-6)))
        return loss / n, norm
