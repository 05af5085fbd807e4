"""The tensor-parallel layout the built-in models share (torchtitan's 2-D one; the module
:mod:`harness.distributed.tensor_parallel` says why each style): the embeddings row-parallel with their output split
along the sequence, the norms under ``SequenceParallel``, the attention's fused ``qkv`` column-parallel with its
output gathered and its output projection row-parallel. The head and each block's MLP are the caller's: the dense
model shards its MLP and may keep the logits sharded on the vocabulary; the mixture-of-experts model runs each MoE
layer on the rank's positions (:mod:`harness.moe_tp`).

This module belongs to the model layer (the dense plan in the distributed layer and the MoE plan beside the model
both build on it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def sequence_parallel_plan(model: nn.Module, head: Any, mlp: Callable[[str], dict[str, Any]],
                           norms: bool = True) -> dict[str, Any]:
    """The ``parallelize_module`` plan of a :class:`harness.model.TinyCausalLM`-shaped ``model`` (``tok``, ``pos``,
    ``blocks.i.{ln1,qkv,proj,ln2,mlp}``, ``ln``, ``head``): ``head`` the head's style, ``mlp(prefix)`` the styles of
    block ``prefix``'s MLP, ``norms=False`` the LayerNorms left plain modules on each rank's positions (as
    hand-written sequence parallelism leaves them)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan: dict[str, Any] = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "head": head,
    }
    names = ["ln"]
    for i in range(len(model.blocks)):  # type: ignore[arg-type]
        b = f"blocks.{i}"
        names += [f"{b}.ln1", f"{b}.ln2"]
        plan |= {
            f"{b}.qkv": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            f"{b}.proj": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            **mlp(b),
        }
    if norms:
        plan |= {name: SequenceParallel() for name in names}
    return plan


__all__ = ["sequence_parallel_plan"]
