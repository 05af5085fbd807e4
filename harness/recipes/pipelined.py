"""The correct recipe on a pipeline (a mesh with pp > 1), and the window driver its negative controls share with it.

A pipelined recipe's ``backward_window`` takes ``pipeline`` (:class:`harness.distributed.pipeline.Pipeline`): every pp
rank receives its data coordinate's whole window, counts its supervised tokens over the token group (dp, never pp: the
pp ranks of one coordinate hold the same tokens) before any backward, then drives the window as ``steps`` schedule
steps of ``n_microbatches`` microbatches each, choosing the loss function and ``scale_grads`` itself. The correct
recipe takes both from the run's plan, ``pipeline.accumulation_steps`` and ``pipeline.n_microbatches``
(``--pp-steps``, ``--pp-microbatches``), as a training loop takes its accumulation steps from its config.

How a window maps to schedule steps: a schedule splits one step's batch into microbatches of equal shape, and the
harness's microbatches differ in rows and length. So the window's microbatches are cut into ``steps`` consecutive
parts, and each part's rows are stacked into one step's batch, padded on the right to the window's longest row and
with wholly ignored rows to the most rows of any part, a multiple of ``n_microbatches``
(:meth:`~harness.distributed.pipeline.Pipeline.batches`): one schedule drives every step, and it infers the stage's
shapes on its first step only. The supervised tokens are the window's own, so a loss sum over the steps is the
window's loss sum; a step that holds none (a window of fewer microbatches than steps gives its first steps none) has
loss 0 and still runs forward and backward on every stage (a stage that skipped it would leave its neighbours waiting
on a send).

Synchronizations: torch's schedules reduce a data-parallel stage's gradient at the end of every step (a DDP stage's
last backward prepares its all-reduce itself, inside ``no_sync()`` or not; an FSDP2 stage's ``perform_reduce_grad``
turns gradient sync back on and reduce-scatters), so a window of A steps synchronizes A times, as torchtitan's
accumulation over PP steps does. A reduced gradient plus the next step's is reduced again to the same sum, so the
result is exact; ``checks.one_sync`` counts one synchronization per recorded schedule step on a pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from harness.core.formats import supervised_tokens
from harness.core.loss import global_token_loss, loss_sum
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.recipes.helpers import global_count, global_sum, require_tokens

NO_PIPELINE = ("this recipe drives a pipeline schedule and got no pipeline: run it over a mesh with pp > 1 "
               "(--mesh pp=2, or dp=2,pp=2)")


def drive(pipeline: Any, window: Sequence[Microbatch], n_microbatches: int, *, steps: int = 1,
          scale_grads: bool = False, loss_factor: float = 1.0, reinitialise: bool = False, count_group: Any = None,
          microbatch_mean: bool = False) -> float:
    """Run ``window`` through ``pipeline`` as ``steps`` schedule steps of ``n_microbatches`` each, with the loss of
    each microbatch ``loss_sum * token_group_size / global_count * loss_factor`` and the schedule's ``scale_grads``;
    returns the window's token mean (the last stage's loss sums, broadcast over pp, summed over the token group, over
    the count): the same on every rank. The correct recipe is ``scale_grads=False``, ``loss_factor=1``, one schedule
    for every step.

    The negative controls' knobs: ``reinitialise`` builds a new schedule per step (the stage's shapes inferred again
    before each); ``count_group``, a process group to reduce the count over instead of the token group (None: the
    token group); ``microbatch_mean``, each schedule microbatch's loss its own token mean (``loss_sum / its
    supervised count * loss_factor``, no global count)."""
    if pipeline is None:
        raise RuntimeError(NO_PIPELINE)
    group = pipeline.token_group
    local_count = sum(supervised_tokens(mb) for mb in window)
    # The count over the token group (dp); without a data-parallel dimension the rank's own count is the window's.
    over = group if count_group is None else count_group
    total = require_tokens(local_count if over is None else global_count(local_count, group=over))
    size = pipeline.token_group_size
    calls: list[tuple[torch.Tensor, float]] = []  # each loss loss_fn returned, with its loss sum

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        s = loss_sum(logits, target)
        if microbatch_mean:
            # A chunk of wholly ignored padding rows holds no token: its mean is taken as 0, not 0/0.
            loss = s / max(int((target != IGNORE_INDEX).sum()), 1) * loss_factor
        else:
            loss = global_token_loss(s, total, size) * loss_factor
        calls.append((loss, float(s.detach())))
        return loss

    batches = pipeline.batches(window, steps, n_microbatches)
    window_sum = 0.0
    schedule = None
    for inputs, labels in batches:
        if schedule is None or reinitialise:
            schedule = pipeline.schedule(loss_fn, n_microbatches, scale_grads=scale_grads)
        calls.clear()
        losses = pipeline.step(schedule, inputs, labels)
        # The step's own microbatches are the losses the schedule returns, the very tensors loss_fn returned: a new
        # schedule's first step also calls loss_fn on the placeholder output it infers the backward's shapes from
        # (every schedule, the interleaved ones too), and that loss is not among them.
        if pipeline.is_last:
            found = [s for loss in losses for t, s in calls if t is loss]
            if len(found) != n_microbatches:
                msg = (f"the schedule returned {len(losses)} losses matching {len(found)} loss_fn calls; expected "
                       f"{n_microbatches}, one per microbatch")
                raise RuntimeError(msg)
            window_sum += sum(found)
    local = pipeline.from_last(window_sum)
    return (local if group is None else global_sum(local, group)) / total


class PipelineTokenMean:
    """The correct recipe on a pipeline: the count over the token group before any backward, each microbatch's loss
    sum times the token group's size over that count (DDP's average over dp undoes the factor), and
    ``scale_grads=False``: the loss is already divided by the window's count, so the schedule must not divide the
    gradients by the number of microbatches again. The window runs as the run's plan says: ``accumulation_steps``
    schedule steps (A, ``--pp-steps``, default 1) of ``n_microbatches`` (M, ``--pp-microbatches``, default 2), all
    by one schedule; one synchronization per step."""

    name = "pipeline_token_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], pipeline: Any = None) -> float:
        if pipeline is None:
            raise RuntimeError(NO_PIPELINE)
        return drive(pipeline, window, pipeline.n_microbatches, steps=pipeline.accumulation_steps)


pipeline_token_mean = PipelineTokenMean()

__all__ = ["NO_PIPELINE", "PipelineTokenMean", "drive", "pipeline_token_mean"]
