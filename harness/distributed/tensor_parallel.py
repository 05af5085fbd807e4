"""Tensor parallelism on a rank: the plan that shards the built-in model over the mesh's ``tp`` dimension, and the
one place a plan (the harness's or a user model's) is applied, before the strategy wraps the model.

The built-in plan follows torchtitan's 2-D layout with DTensor's parallel styles: the token embedding row-parallel
with its output split along the sequence (``Shard(1)``), the position embedding row-parallel with its output split
the same way, every LayerNorm under ``SequenceParallel`` (its weight and bias replicated, their gradients
``Partial`` sums over tp), the MLP column- then row-parallel, the attention's output projection row-parallel, and the
head column-parallel with its logits gathered (``Replicate``), so a recipe sees full logits. The fused ``qkv``
projection is column-parallel with its output gathered: its weight stacks q, k and v, so a contiguous shard of it is
not a set of whole heads, and the attention itself runs on every tp rank. The model pads its sequences to a multiple
of the tp size (``TinyCausalLM.seq_multiple``): gloo reduce-scatters equal shards only.

``vocab_parallel=True`` (the model ``--model harness.model:vocab_parallel``) leaves the head's logits sharded on the
vocabulary instead, ``ColwiseParallel(input_layouts=Shard(1), use_local_output=False)``, torchtitan's layout under
``loss_parallel``: ``model(inputs)`` then returns a DTensor ``[B, T, V]`` placed ``Shard(2)`` over tp, and a recipe
computes its loss (and its backward) inside ``torch.distributed.tensor.parallel.loss_parallel()``
(:mod:`harness.recipes.vocab_parallel`). A user's plan does the same by giving its head that style.

A user's model declares its plan beside its factory: ``factory.tp_plan = plan``, a callable ``plan(model, tp_mesh)``
that shards the model in place (``parallelize_module``), called on every rank with the ``DeviceMesh`` of ``tp``. A
recipe with hand-written tensor-parallel layers declares its own ``tp_plan``, applied instead of the model's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

PLAN_ATTRIBUTE = "tp_plan"
"""The attribute of a ``--model`` factory that holds its tensor-parallel plan: ``plan(model, tp_mesh) -> None``."""

TpPlan = Callable[[nn.Module, Any], None]


def builtin_plan(model: nn.Module, tp_mesh: Any, *, sequence_parallel_norms: bool = True,
                 vocab_parallel: bool = False) -> None:
    """Shard :class:`harness.model.TinyCausalLM` over ``tp_mesh`` in place (the layout in the module's docstring).
    ``sequence_parallel_norms=False`` leaves the LayerNorms plain modules on each rank's positions, as hand-written
    sequence parallelism does: their gradients are then each rank's partial sums, all-reduced by nothing (a negative
    control's plan). ``vocab_parallel=True`` leaves the logits a DTensor sharded on the vocabulary (the loss is then
    computed under ``loss_parallel``); the vocabulary must divide by the tp size."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from harness.tp_layout import sequence_parallel_plan

    vocab = int(model.head.out_features)  # type: ignore[union-attr, arg-type]
    if vocab_parallel and vocab % tp_mesh.size():
        msg = (f"vocab_parallel: the vocabulary ({vocab}) must divide by the tp size ({tp_mesh.size()}) to shard the "
               "logits on it (gloo scatters equal shards only); pick a tp size that divides it")
        raise ValueError(msg)
    head = (ColwiseParallel(input_layouts=Shard(1), use_local_output=False) if vocab_parallel
            else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    plan = sequence_parallel_plan(model, head, lambda b: {f"{b}.mlp.0": ColwiseParallel(input_layouts=Shard(1)),
                                                          f"{b}.mlp.2": RowwiseParallel(output_layouts=Shard(1))},
                                  norms=sequence_parallel_norms)
    # Every rank holds the same full weights (the fingerprint and the start the parent sends are checked before), so
    # each cuts its own shard from them: torch's default scatters rank 0's copy, a collective per parameter.
    parallelize_module(model, tp_mesh, plan, src_data_rank=None)
    # gloo reduce-scatters equal shards only: each tp rank holds as many positions as the others.
    model.seq_multiple = tp_mesh.size()


def vocab_parallel_plan(model: nn.Module, tp_mesh: Any) -> None:
    """:func:`builtin_plan` with the logits left sharded on the vocabulary (``vocab_parallel=True``): the plan of
    ``--model harness.model:vocab_parallel``."""
    builtin_plan(model, tp_mesh, vocab_parallel=True)


def plan_of(model_path: str | None) -> TpPlan:
    """The tensor-parallel plan of the run's model: the built-in one without ``--model``, else the factory's
    :data:`PLAN_ATTRIBUTE`; :class:`harness.model.ModelError` (a ValueError) naming what to add when the factory has
    none."""
    if model_path is None:
        return builtin_plan
    from harness.model import ModelError, load_model_factory

    plan = getattr(load_model_factory(model_path), PLAN_ATTRIBUTE, None)
    if not callable(plan):
        msg = (f"model={model_path!r} runs over a mesh with tp > 1 but its factory has no tensor-parallel plan: set "
               f"{model_path.split(':')[1]}.{PLAN_ATTRIBUTE} = plan, a callable plan(model, tp_mesh) that shards the "
               "model in place with torch.distributed.tensor.parallel.parallelize_module (docs/recipe-contract.md), "
               "or run without tp")
        raise ModelError(msg)
    return plan


def recipe_plan(recipe: object) -> TpPlan | None:
    """The plan a recipe brings with its own tensor-parallel layers (its :data:`PLAN_ATTRIBUTE`: hand-written TP lives
    in the training code, not in the model), which the harness applies instead of the model's; None when it has
    none."""
    plan = getattr(recipe, PLAN_ATTRIBUTE, None)
    return plan if callable(plan) else None


def apply_plan(model: nn.Module, model_path: str | None, tp_mesh: Any, recipe: object = None) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` in place with ``recipe``'s own plan (:func:`recipe_plan`), else the model's
    (:func:`plan_of`); returns ``model``."""
    # Gathering a parameter sharded over dp and tp (FSDP2's _StridedShard) takes two all-gathers, and DTensor logs
    # a warning of it on every rank, once per process; the harness gathers only to compare, so it says nothing.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    (recipe_plan(recipe) or plan_of(model_path))(model, tp_mesh)
    return model


__all__ = ["PLAN_ATTRIBUTE", "TpPlan", "apply_plan", "builtin_plan", "plan_of", "recipe_plan", "vocab_parallel_plan"]
