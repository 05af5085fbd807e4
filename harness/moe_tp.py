"""Tensor parallelism with sequence parallelism for the built-in mixture-of-experts model: its plan, and the model
that declares it (``--model harness.moe_tp:moe``, :func:`harness.moe.moe` with ``tp_plan`` set).

The layout is torchtitan's 2-D one (:func:`harness.distributed.tensor_parallel.builtin_plan`) for everything but the
MoE layers: the embeddings row-parallel with their output split along the sequence (``Shard(1)``), the norms under
``SequenceParallel``, the attention's fused ``qkv`` column-parallel and its output projection row-parallel, the head
column-parallel with its logits gathered. Each :class:`harness.moe.MoELayer` runs on this tp rank's positions only
(its tokens are the sequence shard, torchtitan's layout under sequence parallelism): the router, the experts and the
shared expert are whole on every tp rank (no expert sharding), each applied to this rank's tokens.

A replicated parameter applied to a shard of the tokens has a gradient that is, on each tp rank, the partial sum over
that rank's tokens: it must be summed over tp, or the tp ranks step apart (torchtitan #2387: the router's weight
diverged between tp ranks after the first step). Two ways to do it, both here:

- ``replicated="dtensor"`` (:func:`moe_tp_plan`, the model's plan): every parameter of the MoE layers becomes a
  DTensor ``Replicate()`` over tp, and each of its linear layers computes with the rank's local copy read through
  ``to_local(grad_placements=(Partial(),))``: the gradient that flows back is declared a partial sum, so DTensor
  reduces it over tp, as ``SequenceParallel`` does for the norms. This is the fix torchtitan PR #2416 made at the
  router's boundary (the router's output read as ``to_local(grad_placements=(Partial(),))``), written where the
  partial sum arises here: at the parameters, because this layer's *inputs* are distinct tokens on each rank (a
  ``Replicate`` input would have its gradient all-reduced across different tokens).
- ``replicated="local"``: the parameters stay plain tensors on each rank, and the training code all-reduces their
  gradients over tp after the backward (:func:`sequence_parallel_parameters`; Megatron-LM marks such parameters
  ``sequence_parallel`` and all-reduces their gradients over the tp group in its ``finalize_model_grads``).

Either way the router's decisions are gathered over tp after each forward (:func:`gather_router_outputs`): every tp
rank then reads the whole microbatch's routing in :func:`harness.moe.router_outputs`, as a load-balancing term over
the microbatch's tokens needs, and the gradient of a term computed from it goes back to the rank that routed each
token (the gather's backward keeps this rank's slice: every tp rank computes the same term).

This module belongs to the model layer; it imports :mod:`harness.moe` (never the other way round).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from harness.moe import MoECausalLM, MoELayer, RouterOutput, routed_sum
from harness.moe import moe as _moe

REPLICATED = ("dtensor", "local")
"""How the MoE layers' replicated parameters are held over tp: DTensors whose partial gradients DTensor reduces, or
plain tensors whose gradients the training code reduces."""


class SequenceShardLinear(nn.Linear):
    """An ``nn.Linear`` whose weight and bias are DTensors replicated over tp, applied to this tp rank's tokens: it
    computes with the local copy, read with ``to_local(grad_placements=(Partial(),))`` so that the gradient each rank
    accumulates, its partial sum over its own tokens, is summed over tp by DTensor. Same parameters, same names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else _local_copy(self.bias)
        return F.linear(x, _local_copy(self.weight), bias)


def _local_copy(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Partial

    if isinstance(p, DTensor):
        # The local copy's gradient is this rank's partial sum over its tokens: declared Partial, the parameter's
        # gradient is a Partial DTensor, which FSDP2 (or full_tensor()) all-reduces over tp.
        return p.to_local(grad_placements=(Partial(),))
    return p


def _replicate_parameters(layer: nn.Module, tp_mesh: Any) -> None:
    """Every parameter of ``layer`` a DTensor ``Replicate()`` over ``tp_mesh``, and every linear layer of it a
    :class:`SequenceShardLinear` (the class changes, the module and its parameters' names stay)."""
    from torch.distributed.tensor import DTensor, Replicate

    for module in layer.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            # Every rank holds the same full weights (checked before the plan runs), so each wraps its own copy.
            replicated = DTensor.from_local(p.detach(), tp_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=p.requires_grad))
        if type(module) is nn.Linear:
            module.__class__ = SequenceShardLinear
        elif any(True for _ in module.parameters(recurse=False)):
            msg = (f"{type(module).__name__} in an MoE layer holds parameters the tensor-parallel plan cannot apply "
                   "to a sequence shard: the plan knows nn.Linear only")
            raise TypeError(msg)


def moe_tp_plan(model: nn.Module, tp_mesh: Any, *, replicated: str = "dtensor") -> None:
    """Shard :class:`harness.moe.MoECausalLM` over ``tp_mesh`` in place (the layout in the module's docstring); each
    MoE layer runs on this rank's sequence shard, its parameters held as ``replicated`` says (:data:`REPLICATED`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module

    from harness.tp_layout import sequence_parallel_plan

    if replicated not in REPLICATED:
        msg = f"replicated={replicated!r} must be one of {', '.join(map(repr, REPLICATED))}"
        raise ValueError(msg)
    if not isinstance(model, MoECausalLM):
        msg = (f"moe_tp_plan shards a harness.moe.MoECausalLM, got {type(model).__name__}: a model of your own "
               "declares its own tp_plan")
        raise TypeError(msg)
    # The MoE layer takes this rank's positions as a plain tensor and gives its output back as this rank's part of
    # the sequence: no collective on either side.
    plan = sequence_parallel_plan(
        model, ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        lambda b: {f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=True)})
    parallelize_module(model, tp_mesh, plan, src_data_rank=None)
    for layer in model.moe_layers():
        layer.dispatch = every_expert
        if replicated == "dtensor":
            _replicate_parameters(layer, tp_mesh)
    # gloo reduce-scatters equal shards only: each tp rank holds as many positions as the others.
    model.seq_multiple = tp_mesh.size()
    model.register_forward_hook(_gather_hook(tp_mesh))


def every_expert(layer: MoELayer, flat: torch.Tensor, gates: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum of :func:`harness.moe.routed_sum`, each expert called even on no rows: the tp ranks
    route different tokens, and an expert none of this rank's tokens chose must still leave a (zero) gradient here,
    or the reductions over tp, one per parameter with a gradient, would pair different parameters across the
    ranks."""
    return routed_sum(layer, flat, gates, chosen, range(len(layer.experts)), call_empty=True)


def local_moe_tp_plan(model: nn.Module, tp_mesh: Any) -> None:
    """:func:`moe_tp_plan` with the MoE layers' parameters left plain tensors on each tp rank (``replicated="local"``):
    the plan of hand-written sequence parallelism, whose training code all-reduces their gradients over tp."""
    moe_tp_plan(model, tp_mesh, replicated="local")


def sequence_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every MoE layer of ``model`` (its router, experts and shared expert), in model order: under
    sequence parallelism each tp rank applies them to its own tokens, so their gradients are partial sums over tp."""
    return [p for layer in model.modules() if isinstance(layer, MoELayer) for p in layer.parameters()]


def gather_router_outputs(model: nn.Module, tp_mesh: Any, batch: int, length: int) -> None:
    """Replace each MoE layer's :class:`harness.moe.RouterOutput` of the last forward (this tp rank's positions of
    the ``batch`` rows) by the whole microbatch's (``batch * length`` rows, in ``x.reshape(-1, d)`` order, the
    padding to a multiple of tp dropped). The probabilities keep their gradient: each rank's slice of it goes back to
    the rank that routed those tokens."""
    from torch.distributed.tensor import DTensor, Shard

    for layer in model.modules():
        if not isinstance(layer, MoELayer) or layer.routed is None:
            continue
        out = layer.routed

        def whole(t: torch.Tensor) -> torch.Tensor:
            # [batch * t_local, n] -> [batch, T_padded, n] over tp, rank order along the sequence -> real positions.
            local = t.reshape(batch, -1, t.shape[-1])
            full = DTensor.from_local(local, tp_mesh, [Shard(1)], run_check=False).full_tensor()
            return full[:, :length].reshape(-1, t.shape[-1])

        layer.routed = RouterOutput(out.layer, whole(out.probs), whole(out.chosen))


def _gather_hook(tp_mesh: Any) -> Any:
    def hook(model: nn.Module, args: Any, output: Any) -> None:
        logits = output if isinstance(output, torch.Tensor) else output.logits
        gather_router_outputs(model, tp_mesh, logits.shape[0], logits.shape[1])

    return hook


def moe() -> MoECausalLM:
    """:func:`harness.moe.moe` (the same model, from the same seed) declaring its tensor-parallel plan
    (:func:`moe_tp_plan`): ``--model harness.moe_tp:moe --mesh dp=2,tp=2 --strategy fsdp2``."""
    return _moe()


moe.moe_plan = _moe.moe_plan  # type: ignore[attr-defined]
moe.tp_plan = moe_tp_plan  # type: ignore[attr-defined]


__all__ = ["REPLICATED", "SequenceShardLinear", "gather_router_outputs", "local_moe_tp_plan", "moe", "moe_tp_plan",
           "sequence_parallel_parameters"]
