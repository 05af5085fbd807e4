"""Negative controls, clipping family. Gradient clipping done at the wrong moment or over the wrong gradient: before
the final synchronization, on one rank only, by the norm of one rank's shard under FSDP2.

Each is a recipe that clips (its ``backward_window`` takes ``max_norm``; :func:`harness.recipes.contract.clips`) and
returns ``(loss, norm)``. Each class declares where the battery rejects it and what the diagnosis reads in its
gradient (``@control``, :mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from harness.core.loss import global_token_loss
from harness.core.microbatch import Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.correct import _world_size, accumulate, forward_loss_sum, global_sum, window_count
from harness.recipes.helpers import sync_context


@control(Target("clipping", "long"), "unexplained")
class ClipBeforeFinalSync:
    """Clips between the accumulated microbatches and the last one, whose backward synchronizes: the norm is one
    rank's partial gradient's, and the clip scales a gradient that is not yet the window's. Every rank ends identical
    (a cross-rank check sees nothing); only the reference does."""

    name = "clip_before_final_sync"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch],
                        max_norm: float = 1.0) -> tuple[float, float]:
        total, world = window_count(window), _world_size()
        local, norm = 0.0, 0.0
        for i, mb in enumerate(window):
            if i == len(window) - 1:
                norm = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm))
            with sync_context(model, i, len(window)):
                s = forward_loss_sum(model, mb)
                global_token_loss(s, total, world).backward()
            local += float(s.detach())
        return global_sum(local) / total, norm


@control(Target("ranks_agree", "uneven"), "clipping_not_applied")
class ClipOnOneRank:
    """Clips on rank 0 only (a clip under ``if rank == 0``, next to the logging): the ranks' weights drift apart at
    the first step (the unclipped rank's gradient is the unclipped reference: clipping did not take effect there)."""

    name = "clip_on_one_rank"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch],
                        max_norm: float = 1.0) -> tuple[float, float]:
        total, world = window_count(window), _world_size()
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        limit = max_norm if not dist.is_initialized() or dist.get_rank() == 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), limit))
        return global_sum(local) / total, norm


@control(Target("clipping", "uneven", strategy="fsdp2"), "unexplained")
class LocalShardNorm:
    """Under FSDP2, the norm of this rank's shards (``grad.to_local()``) instead of the global one that
    ``clip_grad_norm_`` returns as a replicated DTensor: each rank clips its shard by its own, wrong, factor."""

    name = "local_shard_norm"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch],
                        max_norm: float = 1.0) -> tuple[float, float]:
        total, world = window_count(window), _world_size()
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        shards = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                  for p in model.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in shards])))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(min(1.0, max_norm / (norm + 1e-6)))
        return global_sum(local) / total, norm
