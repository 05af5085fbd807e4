"""Negative controls, HSDP family. Mistakes that show only when data parallelism has two dimensions, as HSDP gives it
(FSDP2 over ``dp_replicate`` x ``dp_shard``: parameters sharded over ``dp_shard``, each shard replicated over
``dp_replicate``; the gradient averaged over both): a factor that undoes the shard group's average but not the
replicate group's, and a clipping norm whose squared shard norms are summed over the replicas too.

Both are right on a one-dimensional mesh (``dp_replicate=1``), which is where their authors tested them. Each
declares its target on the mesh ``dp_replicate=2,dp_shard=2`` under FSDP2 (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.core.loss import count_device, global_token_loss
from harness.core.microbatch import Microbatch
from harness.distributed.device_mesh import flattened
from harness.distributed.strategies.fsdp2 import local as local_shard
from harness.recipes.catalog import Target, control
from harness.recipes.correct import accumulate, global_sum
from harness.recipes.helpers import (
    global_count,
    require_tokens,
    supervised_tokens,
    token_group,
    token_group_size,
)

HSDP = "dp_replicate=2,dp_shard=2"
"""The smallest mesh where replicate and shard differ: 2 replicas of 2 shards."""


def _count(window: Sequence[Microbatch], mesh: Any) -> int:
    """The window's supervised count over the token group (every rank's tokens once), refused on every rank at 0."""
    return require_tokens(global_count(sum(supervised_tokens(mb) for mb in window), group=token_group(mesh)))


@control(Target("parity", "uneven", strategy="fsdp2", mesh=HSDP), "global_scale")
class ShardGroupFactorOnly:
    """torchtitan #2318: the loss multiplied by the shard group's size (the ``dp_shard`` ranks FSDP2 reduce-scatters
    over) to undo FSDP2's average, where HSDP averages over ``dp_replicate`` x ``dp_shard``: the replicate group's
    average stays, and every gradient is 1/dp_replicate of the truth (0.5 at dp_replicate=2). The factor that undoes
    the reduction is :func:`harness.recipes.helpers.token_group_size` (replicate x shard x cp)."""

    name = "shard_group_factor_only"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        total = _count(window, mesh)
        shard = 1 if mesh is None else int(flattened(mesh, ("dp_shard",)).size())
        local = accumulate(model, window, lambda s: global_token_loss(s, total, shard))
        return global_sum(local, token_group(mesh)) / total


@control(Target("clipping", "uneven", strategy="fsdp2", mesh=HSDP), "clipped_by_wrong_norm")
class NormOverReplicas:
    """VeOmni #184: a hand-written gradient norm under HSDP that sums every rank's squared local shard norms over the
    whole world (replicate x shard). Each replica holds every shard once, so the sum counts the gradient
    ``dp_replicate`` times and the norm is sqrt(dp_replicate) too large (1.414x at 2): every rank clips by the same
    wrong factor. VeOmni's fix (PR #862) sums over the shard group only
    (:func:`harness.recipes.helpers.shard_group`); ``clip_grad_norm_`` over the DTensor gradients does it right."""

    name = "norm_over_replicas"

    def norm_group(self, mesh: Any) -> Any:
        """The group the squared shard norms are summed over. The mistake: the default group, which spans the
        replicas as well as the shards."""
        return None

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], max_norm: float = 1.0,
                        mesh: Any = None) -> tuple[float, float]:
        total = _count(window, mesh)
        local = accumulate(model, window, lambda s: global_token_loss(s, total, token_group_size(mesh)))
        squares = torch.zeros((), dtype=torch.float64, device=count_device())
        for p in model.parameters():
            if p.grad is not None:
                squares += local_shard(p.grad).detach().double().pow(2).sum().to(squares.device)
        if dist.is_initialized():
            dist.all_reduce(squares, group=self.norm_group(mesh))
        norm = math.sqrt(float(squares))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(min(1.0, max_norm / (norm + 1e-6)))
        return global_sum(local, token_group(mesh)) / total, norm
