"""The correct recipe: loss sums, one all-reduced count before any backward, ``no_sync()`` around all but the last
microbatch, and the helpers the controls share with it (each control differs from it by its one mistake).

:class:`GlobalTokenMean` and the shared helpers take a window in either batch format (harness ``Microbatch`` or the
``hf`` or ``packed`` dict, :mod:`harness.core.formats`); :class:`HfGlobalTokenMean` is the same recipe written the
way a Hugging Face training loop is, for ``--batch-format=hf`` or ``packed`` only."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.core.formats import hf_forward, logits_of, shifted_loss_sum, supervised_tokens
from harness.core.loss import global_token_loss, loss_sum
from harness.core.microbatch import IGNORE_INDEX
from harness.recipes.helpers import (
    clip_grad_norm,
    global_count,
    global_sum,
    require_tokens,
    sync_context,
    token_group,
    token_group_size,
)

Batch = Any
"""One microbatch in any format: a :class:`Microbatch`, or the ``hf`` or ``packed`` dict."""


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def window_count(window: Sequence[Batch]) -> int:
    """The global supervised count of the window, all-reduced before any backward; ValueError (on every rank
    alike) when it is 0."""
    # Every rank calls global_count, also a rank whose own count is 0, and every rank sees the same total, so every
    # rank raises together and none is left waiting in a collective.
    return require_tokens(global_count(sum(supervised_tokens(mb) for mb in window)))


def forward_loss_sum(model: nn.Module, mb: Batch, loss_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One microbatch's loss sum in its own format: ``model(inputs)`` against aligned labels, or a dict's call
    (:func:`harness.core.formats.hf_forward`: ``hf`` or ``packed``) against the shifted labels."""
    if isinstance(mb, Mapping):
        logits = hf_forward(model, mb)
        return shifted_loss_sum(logits if loss_dtype is None else logits.to(loss_dtype), mb["labels"])
    # A user's model may return an output object (--model); a cp rank's chunk of a sequence-sharding model says
    # where its columns sit in the full sequence.
    out = model(mb.inputs) if mb.positions is None else model(mb.inputs, position_ids=mb.positions)
    logits = logits_of(out)
    return loss_sum(logits if loss_dtype is None else logits.to(loss_dtype), mb.labels)


def accumulate(
    model: nn.Module,
    window: Sequence[Batch],
    scale: Callable[[torch.Tensor], torch.Tensor],
    *,
    sync_every_microbatch: bool = False,
    loss_dtype: torch.dtype | None = None,
) -> float:
    """Forward and backward of every microbatch with loss ``scale(loss_sum)``; returns this rank's plain loss sum.

    In DDP only the last microbatch needs to synchronize gradients. The ``no_sync()`` context must hold the forward as
    well as the backward, or DDP still prepares a reduction for that pass. (``sync_every_microbatch`` and
    ``loss_dtype`` exist for the negative controls.)
    """
    local = 0.0
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if sync_every_microbatch else sync_context(model, i, len(window)):
            s = forward_loss_sum(model, mb, loss_dtype)
            scale(s).backward()
        local += float(s.detach())
    return local


class GlobalTokenMean:
    """The correct recipe: sums, one all-reduced count before any backward, ``no_sync`` around all but the last. On a
    mesh with pp (``pipeline`` given) it is :data:`harness.recipes.pipelined.pipeline_token_mean`, so that the
    battery's default recipe runs on every mesh the harness runs."""

    name = "global_token_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Batch], pipeline: Any = None) -> float | None:
        if pipeline is not None:
            from harness.recipes.pipelined import pipeline_token_mean

            return pipeline_token_mean.backward_window(model, window, pipeline=pipeline)
        total, world = window_count(window), _world_size()
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        # The logged loss must be the global token mean on every rank, not this rank's share of it.
        return global_sum(local) / total


global_token_mean = GlobalTokenMean()


class MeshTokenMean:
    """The correct recipe on a device mesh: the count all-reduced over the token group (the data-parallel and cp
    dimensions, never tp), and each rank's loss sum scaled by that group's size over the count, which the ranks'
    gradient average over the same group undoes. On ``dp=W`` it is :class:`GlobalTokenMean`."""

    name = "mesh_token_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Batch], mesh: Any = None) -> float | None:
        group = token_group(mesh)
        total = require_tokens(global_count(sum(supervised_tokens(mb) for mb in window), group=group))
        size = token_group_size(mesh)
        local = accumulate(model, window, lambda s: global_token_loss(s, total, size))
        return global_sum(local, group) / total


mesh_token_mean = MeshTokenMean()


class HfGlobalTokenMean:
    """The correct recipe as a Hugging Face training loop writes it (``--batch-format=hf`` or ``packed``): dict
    batches with unshifted labels, ``model(input_ids=..., attention_mask=...)`` (packed: ``input_ids`` and
    ``position_ids``, :func:`harness.core.formats.hf_forward`) without ``labels`` (HF's built-in loss is a per-call
    mean), the shift done once in the loss, summed and divided by the global count."""

    name = "hf_global_token_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Mapping[str, torch.Tensor]]) -> float | None:
        # The count of what the loss will see: labels[:, 1:], after the shift.
        local_count = sum(int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) for batch in window)
        total = require_tokens(global_count(local_count))
        world = _world_size()
        local = 0.0
        for i, batch in enumerate(window):
            with sync_context(model, i, len(window)):
                logits = hf_forward(model, batch)  # packed: input_ids and position_ids, no attention_mask
                shift_logits, shift_labels = logits[:, :-1], batch["labels"][:, 1:]
                s = F.cross_entropy(shift_logits.flatten(0, 1), shift_labels.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
                (s * (world / total)).backward()
            local += float(s.detach())
        return global_sum(local) / total


hf_global_token_mean = HfGlobalTokenMean()


class SkipEmptyWindow:
    """The correct recipe under the other empty-window policy: a window without any supervised token is skipped on
    every rank (no forward, no backward, no gradient left; the loop then skips its optimizer step) instead of raising
    ``ValueError``. The decision is the global count's, the same on every rank, so every rank skips together and none
    is left in a collective; a rank that skipped on its own count would leave its peers in DDP's all-reduce (the
    ``skip_backward_when_empty`` control)."""

    name = "skip_empty_window"

    def backward_window(self, model: nn.Module, window: Sequence[Batch]) -> float | None:
        total, world = global_count(sum(supervised_tokens(mb) for mb in window)), _world_size()
        if total == 0:
            return None
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return global_sum(local) / total


skip_empty_window = SkipEmptyWindow()


class ZeroLossOnEmptyWindow:
    """The correct recipe under the zero-gradient policy with the backward kept: the loss sum divided by
    ``max(count, 1)``, so a window without any supervised token gives a loss of 0 and zero gradients (cross-entropy
    gives ignored positions none) on every rank, and logs 0.0; the loop then skips its optimizer step."""

    name = "zero_loss_on_empty_window"

    def backward_window(self, model: nn.Module, window: Sequence[Batch]) -> float | None:
        total, world = global_count(sum(supervised_tokens(mb) for mb in window)), _world_size()
        local = accumulate(model, window, lambda s: s * (world / max(total, 1)))
        return global_sum(local) / max(total, 1)


zero_loss_on_empty_window = ZeroLossOnEmptyWindow()

CORRECT_RECIPE = "harness.recipes:global_token_mean"
"""The correct recipe's import path: the battery's default ``--recipe`` and the reference column of every table."""


_sync_last = sync_context
"""``no_sync()`` for every microbatch but the last (forward and backward inside it); the controls' name for it."""



class SummedGlobalTokenMean:
    """The correct recipe for a *summing* reduction, as torchtitan writes its loss: each rank's loss sum divided by
    the global count, no world-size factor (the ranks' gradients are summed, not averaged). It declares
    ``reduction = "sum"``, and the harness sums: DDP's hook sums, and FSDP2 gets
    ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` on every sharded module."""

    name = "summed_global_token_mean"
    reduction = "sum"

    def backward_window(self, model: nn.Module, window: Sequence[Batch]) -> float | None:
        total = window_count(window)
        local = accumulate(model, window, lambda s: s / total)
        return global_sum(local) / total


summed_global_token_mean = SummedGlobalTokenMean()


class ClippedGlobalTokenMean:
    """The correct recipe, clipping: the global token mean's gradient, synchronized, then clipped to ``max_norm``
    over every parameter; it returns the loss and the norm before clipping."""

    name = "clipped_global_token_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Batch],
                        max_norm: float = 1.0) -> tuple[float, float]:
        total, world = window_count(window), _world_size()
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        # After the last microbatch's backward: the gradients are synchronized, and their norm is the global one.
        norm = clip_grad_norm(model, max_norm)
        return global_sum(local) / total, norm


clipped_global_token_mean = ClippedGlobalTokenMean()


class MeshClippedTokenMean:
    """:class:`MeshTokenMean`, clipping: the gradient synchronized over the mesh's token group, then clipped to
    ``max_norm`` by the norm of every parameter's full gradient (:func:`harness.recipes.helpers.clip_grad_norm`,
    which computes it across dp and tp alike); it returns the loss and the norm before clipping."""

    name = "mesh_clipped_token_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Batch], max_norm: float = 1.0,
                        mesh: Any = None) -> tuple[float, float]:
        group = token_group(mesh)
        total = require_tokens(global_count(sum(supervised_tokens(mb) for mb in window), group=group))
        size = token_group_size(mesh)
        local = accumulate(model, window, lambda s: global_token_loss(s, total, size))
        norm = clip_grad_norm(model, max_norm)
        return global_sum(local, group) / total, norm


mesh_clipped_token_mean = MeshClippedTokenMean()
