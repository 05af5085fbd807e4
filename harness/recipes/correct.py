"""The correct recipe: loss sums, one all-reduced count before any backward, ``no_sync()`` around all but the last
microbatch, and the helpers the controls share with it (each control differs from it by its one mistake)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from harness.core.loss import check_global_count, count_device, global_count, global_token_loss, loss_sum
from harness.core.microbatch import Microbatch


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def window_count(window: Sequence[Microbatch]) -> int:
    """The global supervised count of the window, all-reduced before any backward; ValueError (on every rank
    alike) when it is 0."""
    # Every rank calls global_count, also a rank whose own count is 0, and every rank sees the same total, so every
    # rank raises together and none is left waiting in a collective.
    total = global_count(sum(mb.supervised for mb in window))
    check_global_count(total)
    return total


def accumulate(
    model: nn.Module,
    window: Sequence[Microbatch],
    scale: Callable[[torch.Tensor], torch.Tensor],
    *,
    sync_every_microbatch: bool = False,
    loss_dtype: torch.dtype | None = None,
) -> float:
    """Forward and backward of every microbatch with loss ``scale(loss_sum)``; returns this rank's plain loss sum.

    In DDP only the last microbatch needs to synchronize gradients. The ``no_sync()`` context must hold the forward as
    well as the backward, or DDP still prepares a reduction for that pass. (``sync_every_microbatch`` and
    ``loss_dtype`` exist for the negative controls.)
    """
    local = 0.0
    for i, mb in enumerate(window):
        last = i == len(window) - 1
        with contextlib.nullcontext() if last or sync_every_microbatch else model.no_sync():  # type: ignore[operator]
            logits = model(mb.inputs)
            s = loss_sum(logits if loss_dtype is None else logits.to(loss_dtype), mb.labels)
            scale(s).backward()
        local += float(s.detach())
    return local


def global_sum(value: float) -> float:
    """All-reduce (SUM) a float in float64 on the count device; the identity outside a process group."""
    if not dist.is_initialized():
        return value
    t = torch.tensor(value, dtype=torch.float64, device=count_device())
    dist.all_reduce(t)
    return float(t)


class GlobalTokenMean:
    """The correct recipe: sums, one all-reduced count before any backward, ``no_sync`` around all but the last."""

    name = "global_token_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        # The logged loss must be the global token mean on every rank, not this rank's share of it.
        return global_sum(local) / total


global_token_mean = GlobalTokenMean()

CORRECT_RECIPE = "harness.recipes:global_token_mean"
"""The correct recipe's import path: the battery's default ``--recipe`` and the reference column of every table."""


def _sync_last(model: nn.Module, i: int, n: int) -> contextlib.AbstractContextManager[object]:
    """``no_sync()`` for every microbatch but the last (forward and backward inside it)."""
    return contextlib.nullcontext() if i == n - 1 else model.no_sync()  # type: ignore[operator]

