"""Recipes: the training step under test, the correct one and the known mistakes.

A recipe's ``backward_window(model, window)`` runs on every rank with ``model`` wrapped in DDP (gradients averaged
over ranks) and ``window`` this rank's microbatches for one optimizer step. It must leave in ``.grad`` the gradient of
``(sum of per-token cross-entropy over every supervised token of every rank's window) / (number of those tokens)``.

``contract`` holds the protocol and the one loader, ``helpers`` what a recipe may use (``global_count``,
``sync_context``, ``require_tokens``), ``correct`` the correct recipes and ``controls`` the negative controls, one
module per family. Every recipe and control is reachable from here too (a control by the name its class registered),
so ``--recipe=harness.recipes:<name>`` names any of them. (The
summing-hook and Join recipes the tests use live in ``tests/support/``, outside the package.)
"""

from __future__ import annotations

from harness.recipes import catalog
from harness.recipes.contract import Recipe, RecipeError, load_recipe, recipe_module, split_recipe_path
from harness.recipes.controls import CONTROLS, DIAGNOSES, NEGATIVE_CONTROLS, SCENARIO_CONTROLS, Target, control_class
from harness.recipes.correct import (
    CORRECT_RECIPE,
    ClippedGlobalTokenMean,
    GlobalTokenMean,
    HfGlobalTokenMean,
    MeshTokenMean,
    SkipEmptyWindow,
    SummedGlobalTokenMean,
    ZeroLossOnEmptyWindow,
    accumulate,
    clipped_global_token_mean,
    global_sum,
    global_token_mean,
    hf_global_token_mean,
    mesh_clipped_token_mean,
    mesh_token_mean,
    skip_empty_window,
    summed_global_token_mean,
    window_count,
    zero_loss_on_empty_window,
)
from harness.recipes.experts import mesh_token_mean_reducing_experts, mesh_token_mean_with_router_balance
from harness.recipes.helpers import (
    clip_grad_norm,
    data_group,
    data_group_size,
    expert_data_group,
    expert_divide_factor,
    generators_kept,
    global_count,
    held_experts,
    require_tokens,
    shard_group,
    supervised_tokens,
    sync_context,
    token_group,
    token_group_size,
)
from harness.recipes.pipelined import PipelineTokenMean, pipeline_token_mean


def __getattr__(name: str) -> type:
    """``harness.recipes.<control>`` (so ``--recipe=harness.recipes:<control>``): the class registered under that
    name in :mod:`harness.recipes.controls` (each rank builds its own instance), or the control class of that name."""
    return control_class(name)


def __dir__() -> list[str]:
    return sorted([*globals(), *CONTROLS, *(control_class(n).__name__ for n in CONTROLS)])


__all__ = [
    "CONTROLS",
    "CORRECT_RECIPE",
    "DIAGNOSES",
    "NEGATIVE_CONTROLS",
    "SCENARIO_CONTROLS",
    "GlobalTokenMean",
    "HfGlobalTokenMean",
    "MeshTokenMean",
    "PipelineTokenMean",
    "ClippedGlobalTokenMean",
    "SummedGlobalTokenMean",
    "SkipEmptyWindow",
    "ZeroLossOnEmptyWindow",
    "Recipe",
    "RecipeError",
    "Target",
    "accumulate",
    "catalog",
    "clip_grad_norm",
    "data_group",
    "data_group_size",
    "expert_data_group",
    "expert_divide_factor",
    "held_experts",
    "mesh_token_mean_reducing_experts",
    "mesh_token_mean_with_router_balance",
    "generators_kept",
    "global_count",
    "global_sum",
    "global_token_mean",
    "hf_global_token_mean",
    "mesh_token_mean",
    "mesh_clipped_token_mean",
    "pipeline_token_mean",
    "clipped_global_token_mean",
    "summed_global_token_mean",
    "skip_empty_window",
    "zero_loss_on_empty_window",
    "load_recipe",
    "recipe_module",
    "require_tokens",
    "split_recipe_path",
    "supervised_tokens",
    "sync_context",
    "shard_group",
    "token_group",
    "token_group_size",
    "window_count",
    *CONTROLS,
]
