"""Negative controls, expert-parallel family (``--mesh dp=2,ep=2`` or ``ep=2``, ``--model harness.moe:moe``): the
expert gradients reduced over the right group but divided by the wrong number, and the router cut off from the main
loss by a gather without autograd. Each is the public record's mistake at the factor its issue states; the diagnosis
reads the experts, the router and the dense parameters apart (:mod:`harness.diagnosis.experts`). The correct recipes
of the same cases are ``harness.recipes:mesh_token_mean`` and ``mesh_token_mean_reducing_experts``."""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from harness.moe import shard_experts
from harness.recipes.catalog import Target, control
from harness.recipes.correct import MeshTokenMean
from harness.recipes.experts import MeshTokenMeanReducingExperts, MeshTokenMeanWithRouterBalance
from harness.recipes.helpers import expert_data_group

MOE = "harness.moe:moe"
EP_MESH = "dp=2,ep=2"


def _edp_size(mesh: Any) -> int:
    import torch.distributed as dist

    group = expert_data_group(mesh)
    return 1 if group is None else dist.get_world_size(group)


@control(Target("parity", "uneven", mesh=EP_MESH, model=MOE), "experts_scaled")
class ExpertsAveragedOverExpertData(MeshTokenMeanReducingExperts):
    """The expert gradients averaged over the expert-data group (divided by its own size) instead of by the whole
    token group's: DeepSpeed #6545 (PR #6546). Every expert parameter comes out ep times too large; every dense one
    is right."""

    name = "experts_averaged_over_expert_data"

    def divide(self, mesh: Any) -> float:
        return float(_edp_size(mesh))


@control(Target("parity", "uneven", mesh="ep=2", model=MOE), "experts_scaled")
class ExpertsNeverDividedAtFullEp(MeshTokenMeanReducingExperts):
    """At ep equal to the whole token group the expert-data group is one rank, and the division by the token
    group's size is skipped with the (empty) reduction: pytorch PR #167178 (FSDP2 ignored
    ``gradient_divide_factor`` when ep = world). The experts come out ep = W times too large."""

    name = "experts_never_divided_at_full_ep"

    def divide(self, mesh: Any) -> float:
        return 1.0


@control(Target("parity", "uneven", mesh=EP_MESH, model=MOE, strategy="fsdp2"), "experts_scaled")
class Fsdp2ExpertsAveragedOverTheirMesh(MeshTokenMean):
    """Under FSDP2, the expert modules left to average over their own shard mesh (the expert-data group): FSDP2's
    default, torchtitan's EP before PR #1551 (pytorch #160285), Megatron-FSDP's reduce-scatter AVG (PR #5956). The
    recipe resets each expert module's divide factor to its mesh's size in ``setup``: every sharded module whose
    parameters are all held experts (the built-in model's ``blocks.0.mlp.experts.<e>``, torchtitan's
    ``layers.0.moe.routed_experts.inner_experts``)."""

    name = "fsdp2_experts_averaged_over_their_mesh"

    def setup(self, model: nn.Module, mesh: Any = None) -> None:
        from torch.distributed.fsdp import FSDPModule

        size = float(_edp_size(mesh))
        layout = getattr(model, "expert_layout", None)
        held = set() if layout is None else set(layout.held)
        for name, module in model.named_modules():
            own = [f"{name}.{n}" for n, _ in module.named_parameters()]
            if isinstance(module, FSDPModule) and module is not model and own and all(n in held for n in own):
                module.set_gradient_divide_factor(size)


@control(Target("parity", "uneven", mesh="dp_shard=2,ep=2", model=MOE, strategy="fsdp2"), "router_cut_off")
class RouterGatesWithoutGrad(MeshTokenMeanWithRouterBalance):
    """An expert-parallel layer that sends the routing gates to the expert ranks with a plain ``all_gather``, which
    carries no gradient: the router learns from its load-balancing term alone, nothing from the main loss (NeMo
    Automodel PR #2995). The recipe brings its own ``ep_plan``, the built-in one with the gates gathered as plain
    values; the correct recipe of the case is ``mesh_token_mean_with_router_balance``. Judged under FSDP2 (NeMo
    Automodel's strategy): under DDP with ``find_unused_parameters=True``, which a model declaring experts needs, DDP
    marks the router unused after the forward and the auxiliary term's backward then raises "Expected to mark a
    variable ready only once"."""

    name = "router_gates_without_grad"
    ep_plan = staticmethod(partial(shard_experts, gates_with_grad=False))


experts_averaged_over_expert_data = ExpertsAveragedOverExpertData()
experts_never_divided_at_full_ep = ExpertsNeverDividedAtFullEp()
fsdp2_experts_averaged_over_their_mesh = Fsdp2ExpertsAveragedOverTheirMesh()
router_gates_without_grad = RouterGatesWithoutGrad()

__all__ = ["ExpertsAveragedOverExpertData", "ExpertsNeverDividedAtFullEp", "Fsdp2ExpertsAveragedOverTheirMesh",
           "RouterGatesWithoutGrad"]
