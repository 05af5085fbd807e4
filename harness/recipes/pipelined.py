"""The correct recipe on a pipeline (a mesh with pp > 1), and the window driver its negative controls share with it.

A pipelined recipe's ``backward_window`` takes ``pipeline`` (:class:`harness.distributed.pipeline.Pipeline`): every pp
rank receives its data coordinate's whole window, counts its supervised tokens over the token group (dp, never pp: the
pp ranks of one coordinate hold the same tokens) before any backward, then drives the window as ``steps`` schedule
steps of ``n_microbatches`` microbatches each, choosing the loss function and ``scale_grads`` itself.

How a window maps to schedule steps: a schedule splits one step's batch into microbatches of equal shape, and the
harness's microbatches differ in rows and length. So the window's microbatches are cut into ``steps`` consecutive
parts, and each part's rows are stacked into one step's batch, padded on the right to the part's longest row and with
wholly ignored rows to a multiple of ``n_microbatches`` (:meth:`~harness.distributed.pipeline.Pipeline.batch`). The
supervised tokens are the window's own, so a loss sum over the steps is the window's loss sum.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from harness.core.formats import supervised_tokens
from harness.core.loss import global_token_loss, loss_sum
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.recipes.correct import global_sum
from harness.recipes.helpers import global_count, require_tokens

NO_PIPELINE = ("this recipe drives a pipeline schedule and got no pipeline: run it over a mesh with pp > 1 "
               "(--mesh pp=2, or dp=2,pp=2)")


def parts(window: Sequence[Microbatch], steps: int) -> list[list[Microbatch]]:
    """``window``'s microbatches in ``steps`` consecutive non-empty parts (the earlier parts one longer where they do
    not divide evenly); ValueError when the window has fewer microbatches than steps."""
    if len(window) < steps:
        msg = f"a window of {len(window)} microbatches cannot run as {steps} schedule steps"
        raise ValueError(msg)
    cuts = [len(window) * i // steps for i in range(steps + 1)]
    return [list(window[a:b]) for a, b in itertools.pairwise(cuts)]


def drive(pipeline: Any, window: Sequence[Microbatch], n_microbatches: int, *, steps: int = 1,
          scale_grads: bool = False, loss_factor: float = 1.0, count_group: Any = None,
          microbatch_mean: bool = False) -> float:
    """Run ``window`` through ``pipeline`` as ``steps`` schedule steps of ``n_microbatches`` each, with the loss of
    each microbatch ``loss_sum * token_group_size / global_count * loss_factor`` and the schedule's ``scale_grads``;
    returns the window's token mean (the last stage's loss sums, broadcast over pp, summed over the token group, over
    the count): the same on every rank. The correct recipe is ``scale_grads=False``, ``loss_factor=1``.

    The negative controls' knobs: ``count_group``, a process group to reduce the count over instead of the token
    group (None: the token group); ``microbatch_mean``, each schedule microbatch's loss its own token mean
    (``loss_sum / its supervised count * loss_factor``, no global count)."""
    if pipeline is None:
        raise RuntimeError(NO_PIPELINE)
    group = pipeline.token_group
    local_count = sum(supervised_tokens(mb) for mb in window)
    # The count over the token group (dp); without a data-parallel dimension the rank's own count is the window's.
    over = group if count_group is None else count_group
    total = require_tokens(local_count if over is None else global_count(local_count, group=over))
    size = pipeline.token_group_size
    sums: list[float] = []

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        s = loss_sum(logits, target)
        sums.append(float(s.detach()))
        if microbatch_mean:
            # A chunk of wholly ignored padding rows holds no token: its mean is taken as 0, not 0/0.
            return s / max(int((target != IGNORE_INDEX).sum()), 1) * loss_factor
        return global_token_loss(s, total, size) * loss_factor

    window_sum = 0.0
    for part in parts(window, steps):
        schedule = pipeline.schedule(loss_fn, n_microbatches, scale_grads=scale_grads)
        inputs, labels = pipeline.batch(part, n_microbatches)
        sums.clear()
        pipeline.step(schedule, inputs, labels)
        # The step's own microbatches: the schedule's first step also calls loss_fn on the placeholder output it
        # infers the backward's shapes from.
        window_sum += sum(sums[len(sums) - n_microbatches:]) if pipeline.is_last else 0.0
    local = pipeline.from_last(window_sum)
    return (local if group is None else global_sum(local, group)) / total


class PipelineTokenMean:
    """The correct recipe on a pipeline: the count over the token group before any backward, each microbatch's loss
    sum times the token group's size over that count (DDP's average over dp undoes the factor), and
    ``scale_grads=False``: the loss is already divided by the window's count, so the schedule must not divide the
    gradients by the number of microbatches again. One schedule step per window (one synchronization)."""

    name = "pipeline_token_mean"
    n_microbatches = 2

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], pipeline: Any = None) -> float:
        return drive(pipeline, window, self.n_microbatches)


pipeline_token_mean = PipelineTokenMean()

__all__ = ["NO_PIPELINE", "PipelineTokenMean", "drive", "parts", "pipeline_token_mean"]
