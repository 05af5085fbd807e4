"""Recipes for expert parallelism (``--mesh dp=2,ep=2 --model harness.moe:moe``).

The correct recipe there is :class:`harness.recipes.correct.MeshTokenMean`: the count over the token group (ep is a
data dimension: its ranks hold distinct tokens), and the harness's strategy reduces the experts over the expert-data
group. :class:`MeshTokenMeanReducingExperts` is the same step written the way DeepSpeed's and Megatron's engines
are, reducing the expert gradients itself (it declares ``reduces_experts = True``): summed over
:func:`~harness.recipes.helpers.expert_data_group` and divided by
:func:`~harness.recipes.helpers.expert_divide_factor`, the whole token group's size. The controls of the family
(:mod:`harness.recipes.controls.expert_parallel`) get that reduction wrong the ways the public record did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.distributed.expert_parallel import sum_and_divide
from harness.moe import load_balancing_loss, router_outputs
from harness.recipes.correct import MeshTokenMean
from harness.recipes.helpers import data_group_size, expert_data_group, expert_divide_factor, held_experts
from harness.recipes.objectives import _MeshAuxiliary, data_microbatches


def reduce_experts(model: nn.Module, mesh: Any, divide: float) -> None:
    """Sum every held expert's gradient over the expert-data group (one flat all-reduce; none where the group is
    this rank alone) and divide it by ``divide``."""
    sum_and_divide(held_experts(model), expert_data_group(mesh), divide)


class MeshTokenMeanReducingExperts(MeshTokenMean):
    """:class:`~harness.recipes.correct.MeshTokenMean`, reducing the expert gradients itself after the window's
    last backward (under DDP: the harness's DDP leaves the experts to it)."""

    name = "mesh_token_mean_reducing_experts"
    reduces_experts = True

    def divide(self, mesh: Any) -> float:
        """What the experts' sum is divided by (the whole token group's size)."""
        return float(expert_divide_factor(mesh))

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        logged = super().backward_window(model, window, mesh)
        reduce_experts(model, mesh, self.divide(mesh))
        return logged


class MeshTokenMeanWithRouterBalance(_MeshAuxiliary):
    """The token mean plus the router's load-balancing term (:func:`harness.moe.load_balancing_loss` over the
    supervised tokens, times :data:`ROUTER_BALANCE`), one value per microbatch averaged over every microbatch of the
    data group, on a mesh or dp=W; the MoE model's own router probabilities feed it."""

    name = "mesh_token_mean_with_router_balance"
    auxiliary_unit = "microbatch"

    def auxiliary_loss(self, model: nn.Module, batch: Microbatch, logits: torch.Tensor) -> torch.Tensor:
        return ROUTER_BALANCE * load_balancing_loss(router_outputs(model), batch.labels != IGNORE_INDEX)

    def auxiliary_scale(self, window: Sequence[Microbatch], mesh: Any, tokens: int) -> float:
        return data_group_size(mesh) / data_microbatches(window, mesh)


ROUTER_BALANCE = 0.1
"""The load-balancing term's coefficient (Switch Transformer's 1e-2 scaled up so its gradient is well above the
tolerances)."""

mesh_token_mean_reducing_experts = MeshTokenMeanReducingExperts()
mesh_token_mean_with_router_balance = MeshTokenMeanWithRouterBalance()

__all__ = ["ROUTER_BALANCE", "MeshTokenMeanReducingExperts", "MeshTokenMeanWithRouterBalance",
           "mesh_token_mean_reducing_experts", "mesh_token_mean_with_router_balance", "reduce_experts"]
