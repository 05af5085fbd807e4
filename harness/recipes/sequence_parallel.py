"""Correct recipes with hand-written sequence parallelism in a mixture-of-experts model (``--model harness.moe_tp:moe
--mesh dp=2,tp=2 --strategy fsdp2``), Megatron-LM's way: each brings its own ``tp_plan``
(:func:`harness.moe_tp.local_moe_tp_plan`, applied instead of the model's), which leaves the MoE layers' router,
experts and shared expert plain tensors on each tp rank, applied to that rank's sequence shard; after the window's
last backward the recipe sums their gradients over tp itself (Megatron-LM all-reduces the gradients of the
parameters it marks ``sequence_parallel`` over the tp group in ``finalize_model_grads``)::

    python -m harness battery --model harness.moe_tp:moe --mesh dp=2,tp=2 --strategy fsdp2 \\
        --recipe harness.recipes.sequence_parallel:mesh_token_mean_reducing_over_tp

Without that sum each tp rank keeps its own partial gradient and the tp ranks step apart (torchtitan #2387), the
control ``router_grads_not_reduced_over_tp`` (:mod:`harness.recipes.controls.tensor_parallel`). The model's own plan
(:func:`harness.moe_tp.moe_tp_plan`) lets DTensor do the sum instead, and the plain ``harness.recipes:mesh_token_mean``
passes on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from harness.core.microbatch import Microbatch
from harness.distributed.expert_parallel import sum_and_divide
from harness.moe_tp import local_moe_tp_plan, sequence_parallel_parameters
from harness.recipes.correct import MeshTokenMean
from harness.recipes.experts import MeshTokenMeanWithRouterBalance


def tp_group(mesh: Any) -> Any:
    """The process group of ``mesh``'s ``tp`` dimension (the ranks holding the same tokens, each a shard of their
    sequence); ValueError on a mesh without tp."""
    names = () if mesh is None else tuple(mesh.mesh_dim_names)
    if "tp" not in names:
        msg = (f"mesh={names!r} has no tp dimension: a recipe with hand-written sequence parallelism runs over a mesh "
               "with tp, e.g. --mesh dp=2,tp=2 --strategy fsdp2")
        raise ValueError(msg)
    return mesh["tp"].get_group()


def reduce_over_tp(model: nn.Module, mesh: Any) -> None:
    """Sum the gradients of the MoE layers' parameters (:func:`harness.moe_tp.sequence_parallel_parameters`) over tp,
    in one flat all-reduce: each tp rank holds the partial sum over its own positions. Under FSDP2 each gradient is
    already this rank's shard of the average over dp, the same shard on every tp rank of the dp coordinate."""
    sum_and_divide(sequence_parallel_parameters(model), tp_group(mesh), 1.0)


class _ReducingOverTp:
    """A recipe whose MoE layers are held locally on each tp rank (:func:`harness.moe_tp.local_moe_tp_plan`), their
    gradients summed over tp after the window's last backward (the recipe it is mixed into computes the loss)."""

    tp_plan = staticmethod(local_moe_tp_plan)

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        logged = super().backward_window(model, window, mesh)  # type: ignore[misc]
        reduce_over_tp(model, mesh)
        return logged


class MeshTokenMeanReducingOverTp(_ReducingOverTp, MeshTokenMean):
    """:class:`harness.recipes.correct.MeshTokenMean`, with the MoE layers held locally on each tp rank and their
    gradients summed over tp after the window's last backward."""

    name = "mesh_token_mean_reducing_over_tp"


class RouterBalanceReducingOverTp(_ReducingOverTp, MeshTokenMeanWithRouterBalance):
    """:class:`harness.recipes.experts.MeshTokenMeanWithRouterBalance` (the token mean plus the router's
    load-balancing term) with the MoE layers held locally on each tp rank and their gradients summed over tp."""

    name = "router_balance_reducing_over_tp"


mesh_token_mean_reducing_over_tp = MeshTokenMeanReducingOverTp()
router_balance_reducing_over_tp = RouterBalanceReducingOverTp()

__all__ = ["MeshTokenMeanReducingOverTp", "RouterBalanceReducingOverTp", "mesh_token_mean_reducing_over_tp",
           "reduce_over_tp", "router_balance_reducing_over_tp", "tp_group"]
