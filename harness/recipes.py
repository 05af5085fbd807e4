"""Recipes: the training step under test, the correct one and the known mistakes.

A recipe's ``backward_window(model, window)`` runs on every rank with ``model`` wrapped in DDP (gradients averaged
over ranks) and ``window`` this rank's microbatches for one optimizer step. It must leave in ``.grad`` the gradient of
``(sum of per-token cross-entropy over every supervised token of every rank's window) / (number of those tokens)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch.distributed as dist
from torch import nn

from harness.batching import Microbatch
from harness.loss import check_global_count, global_count, global_token_loss, loss_sum


@runtime_checkable
class Recipe(Protocol):
    name: str

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None: ...


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class GlobalTokenMean:
    """The correct recipe: sums, one all-reduced count before any backward, ``no_sync`` around all but the last."""

    name = "global_token_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        world = _world_size()
        # The denominator covers the whole window on every rank, so it is counted (and all-reduced) before the
        # first backward; every rank calls global_count, also a rank whose count is 0.
        total = global_count(sum(mb.supervised for mb in window))
        # Every rank saw the same total, so every rank raises here together and none waits in a collective.
        check_global_count(total)
        logged = 0.0
        for i, mb in enumerate(window):
            last = i == len(window) - 1
            # In DDP only the last microbatch needs to synchronize gradients; the context must hold the forward
            # as well as the backward, or DDP still prepares a reduction for this pass.
            with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
                s = loss_sum(model(mb.inputs), mb.labels)
                global_token_loss(s, total, world).backward()
            logged += float(s.detach())
        # The logged loss must be the global token mean on every rank, not this rank's share of it.
        return global_sum(logged) / total


def global_sum(value: float) -> float:
    """All-reduce (SUM) a float in float64 on the count device; the identity outside a process group."""
    if not dist.is_initialized():
        return value
    import torch

    from harness.loss import count_device

    t = torch.tensor(value, dtype=torch.float64, device=count_device())
    dist.all_reduce(t)
    return float(t)


global_token_mean = GlobalTokenMean()
