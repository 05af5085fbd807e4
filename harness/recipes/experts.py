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

from torch import nn

from harness.core.microbatch import Microbatch
from harness.distributed.expert_parallel import sum_and_divide
from harness.recipes.correct import MeshTokenMean
from harness.recipes.helpers import expert_data_group, expert_divide_factor, held_experts
from harness.recipes.moe_terms import RouterBalancePerMicrobatch


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


class MeshTokenMeanWithRouterBalance(RouterBalancePerMicrobatch):
    """The token mean plus the router's load-balancing term, one value per microbatch averaged over every microbatch
    of the data group (:class:`harness.recipes.moe_terms.RouterBalancePerMicrobatch`), under the name the
    expert-parallel and tensor-parallel recipes and controls of the MoE model build on."""

    name = "mesh_token_mean_with_router_balance"


mesh_token_mean_reducing_experts = MeshTokenMeanReducingExperts()
mesh_token_mean_with_router_balance = MeshTokenMeanWithRouterBalance()

__all__ = ["MeshTokenMeanReducingExperts", "MeshTokenMeanWithRouterBalance",
           "mesh_token_mean_reducing_experts", "mesh_token_mean_with_router_balance", "reduce_experts"]
