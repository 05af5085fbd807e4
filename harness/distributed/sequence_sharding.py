"""Sequence sharding under context parallelism: a model that shards the sequence itself receives only its cp rank's
chunk of each microbatch (:func:`harness.data.context_parallel.shard_chunk`: the chunk's columns and their positions
in the full sequence), and its attention gathers the keys and values of the other cp ranks' chunks.

A model declares it beside its factory, ``factory.cp_plan = plan``, a callable ``plan(model, cp_mesh)`` that makes
the model's attention gather over ``cp_mesh`` (called on every rank, before the strategy wraps the model);
``harness.model:sequence_sharded`` is the built-in model declared so (``harness.model.builtin_cp_plan``, its
attention ``harness.model.gathered_attention``). The recipe then passes each chunk's positions to the model:
``model(mb.inputs, position_ids=mb.positions)`` (:func:`harness.recipes.correct.forward_loss_sum` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

PLAN_ATTRIBUTE = "cp_plan"
"""The attribute of a ``--model`` factory that declares the model shards the sequence: ``plan(model, cp_mesh)``."""

CpPlan = Callable[[nn.Module, Any], None]

def plan_of(model_path: str | None) -> CpPlan | None:
    """The cp plan a ``--model`` factory declares (None: the model takes whole sequences)."""
    if model_path is None:
        return None
    from harness.model import load_model_factory

    plan = getattr(load_model_factory(model_path), PLAN_ATTRIBUTE, None)
    if plan is not None and not callable(plan):
        msg = (f"model={model_path!r}: its {PLAN_ATTRIBUTE} is a {type(plan).__name__}, not a callable "
               "plan(model, cp_mesh)")
        raise ValueError(msg)
    return plan


__all__ = ["PLAN_ATTRIBUTE", "plan_of"]
