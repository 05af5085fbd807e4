"""Negative controls, tensor-parallel family. Mistakes that show once a model is sharded over a ``tp`` dimension of
the mesh, whose ranks hold the same tokens: a count reduced over the default (world) group, which counts each token
once per tp rank; the world size where the token group's size belongs; hand-written sequence-parallel norms whose
gradients are never all-reduced over tp; and a clipping norm from each rank's local shards.

Each runs under FSDP2 over dp with TP over tp (``--mesh dp=2,tp=2 --strategy fsdp2``: DDP cannot wrap a DTensor
model) and declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it. The correct recipe of the same case is
``harness.recipes:mesh_token_mean`` (``mesh_clipped_token_mean`` for clipping)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.core.formats import supervised_tokens
from harness.core.loss import global_token_loss
from harness.core.microbatch import Microbatch
from harness.distributed.tensor_parallel import builtin_plan
from harness.moe_tp import local_moe_tp_plan
from harness.recipes.catalog import Target, control
from harness.recipes.correct import MeshTokenMean, accumulate, global_sum
from harness.recipes.helpers import global_count, require_tokens, token_group, token_group_size

TP_MESH = "dp=2,tp=2"
"""The mesh every control here is judged on: two data coordinates, each sharded over two tp ranks."""


def _tp_target(check: str, scenario: str = "uneven") -> Target:
    return Target(check, scenario, strategy="fsdp2", mesh=TP_MESH)


def _window_count(window: Sequence[Microbatch], group: Any) -> int:
    return require_tokens(global_count(sum(supervised_tokens(mb) for mb in window), group=group))


@control(_tp_target("parity"), "count_group")
class CountOverWorldUnderTp:
    """The count all-reduced over the default group (every rank), as a data-parallel loop written before TP does:
    each tp rank holds the same tokens, so every token is counted tp times and every gradient is exactly 1/tp of the
    reference. The factor is the token group's size, as it should be; only the count's group is wrong."""

    name = "count_over_world_under_tp"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        total = _window_count(window, None)
        size = token_group_size(mesh)
        local = accumulate(model, window, lambda s: global_token_loss(s, total, size))
        return global_sum(local, token_group(mesh)) / total


@control(_tp_target("parity"), "global_scale")
class WorldSizeFactorUnderTp:
    """The count over the token group (right), but the loss scaled by ``dist.get_world_size()`` where the size of
    the group the gradient is averaged over (dp x cp) belongs: FSDP2 averages over dp only, so every gradient is
    exactly tp times the reference."""

    name = "world_size_factor_under_tp"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        group = token_group(mesh)
        total = _window_count(window, group)
        world = dist.get_world_size()
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return global_sum(local, group) / total


def norms_left_local(model: nn.Module, tp_mesh: Any) -> None:
    """The built-in plan with hand-written sequence parallelism on the LayerNorms: each norm runs on this rank's
    positions with plain (not DTensor) parameters, so its weight and bias gradients are this rank's partial sums,
    and nothing all-reduces them over tp (``SequenceParallel`` does, by making them ``Partial``)."""
    builtin_plan(model, tp_mesh, sequence_parallel_norms=False)


@control(_tp_target("ranks_agree"), "not_reduced_over_group")
class NormGradsNotReducedOverTp(MeshTokenMean):
    """Hand-written tensor parallelism with sequence parallelism (``tp_plan``: :func:`norms_left_local`), whose
    replicated LayerNorm weights are updated from each rank's gradient over its own positions, never all-reduced
    over tp: the norms' gradients are partial sums, the tp ranks of one data coordinate step apart, and parity
    misses the reference on those parameters. The loss is the correct recipe's (:class:`MeshTokenMean`)."""

    name = "norm_grads_not_reduced_over_tp"
    tp_plan = staticmethod(norms_left_local)


@control(_tp_target("clipping"), "clipped_by_wrong_norm")
class LocalShardNormUnderTp:
    """torchtune #2420: the clipping norm from each rank's local shards (``grad.to_local()``), summed over the
    data-parallel group that FSDP2 shards over but not over tp: each tp rank misses the other tp ranks' slices of
    every sharded weight, so its norm is too small and each tp rank clips by its own factor. (``clip_grad_norm_``
    itself raised on these gradients in torch 2.13; :func:`harness.recipes.helpers.clip_grad_norm` is the fix.)"""

    name = "local_shard_norm_under_tp"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], max_norm: float = 1.0,
                        mesh: Any = None) -> tuple[float, float]:
        group = token_group(mesh)
        total = _window_count(window, group)
        size = token_group_size(mesh)
        local = accumulate(model, window, lambda s: global_token_loss(s, total, size))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        squares = sum((g.to_local() if hasattr(g, "to_local") else g).double().pow(2).sum() for g in grads)
        squares = torch.as_tensor(squares, dtype=torch.float64)
        dist.all_reduce(squares, group=group)
        norm = float(squares.sqrt())
        with torch.no_grad():
            for g in grads:
                g.mul_(min(1.0, max_norm / (norm + 1e-6)))
        return global_sum(local, group) / total, norm


MOE_TP_MODEL = "harness.moe_tp:moe"
"""The built-in mixture-of-experts model declaring its tensor-parallel plan with sequence parallelism."""


@control(Target("ranks_agree", "uneven", strategy="fsdp2", mesh=TP_MESH, model=MOE_TP_MODEL),
         "not_reduced_over_group")
class RouterGradsNotReducedOverTp(MeshTokenMean):
    """torchtitan #2387: hand-written sequence parallelism in a mixture-of-experts model (``tp_plan``:
    :func:`harness.moe_tp.local_moe_tp_plan`), each tp rank applying the router, the experts and the shared expert,
    plain tensors, to its own positions, and nothing summing their gradients over tp: each rank keeps the partial sum
    over its positions, the router's weight steps apart between the tp ranks. The loss is the correct recipe's; the
    fix is :func:`harness.recipes.sequence_parallel.reduce_over_tp` after the backward (or the model's DTensor plan)."""

    name = "router_grads_not_reduced_over_tp"
    tp_plan = staticmethod(local_moe_tp_plan)
