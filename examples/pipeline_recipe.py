"""A pipelined recipe to copy into your own project: the global token mean over a ``torch.distributed.pipelining``
schedule, with gradient accumulation over several schedule steps per window.

Check it (or your edited copy) with the battery, on a mesh with pp:

    pytest --pyargs harness.battery --recipe=pipeline_recipe:recipe --mesh pp=2 --pp-schedule 1f1b
    pytest --pyargs harness.battery --recipe=pipeline_recipe:recipe --mesh dp=2,pp=2 --strategy fsdp2

On such a mesh each rank holds one stage of the model, and the harness passes ``pipeline``
(``harness.distributed.pipeline.Pipeline``): the rank's stage, the schedule of ``--pp-schedule`` built on request,
and the groups to count over. Every pp rank receives its data coordinate's whole window, as torchtitan gives every
rank the batch, so the count is known before the first schedule step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100
STEPS = 2
"""Schedule steps per window (gradient accumulation over steps: A)."""
MICROBATCHES = 2
"""Microbatches per schedule step (M)."""


class PipelineRecipe:
    name = "example_pipeline_token_mean"

    def backward_window(self, model: torch.nn.Module, window: Sequence, pipeline: Any = None) -> float:
        if pipeline is None:
            raise RuntimeError("run this recipe over a mesh with pp > 1 (--mesh pp=2)")
        p = pipeline
        group = p.token_group  # dp: the ranks that hold different tokens; None at pp alone
        size = p.token_group_size
        # 1. Count the window's supervised tokens over the token group *before* any schedule step. Never over the
        #    whole world: the pp ranks of one data coordinate hold the same tokens, so a count over dp x pp counts
        #    each token pp times and divides the gradient by pp.
        count = torch.tensor(sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in window), dtype=torch.int64)
        if group is not None:
            dist.all_reduce(count, group=group)
        total = int(count)
        if total == 0:  # every rank of the group sees the same total and raises together
            raise ValueError("no supervised token in the global accumulation window")
        sums: list[float] = []

        # 2. The loss of each microbatch is its *sum* scaled by size / total: DDP's (or FSDP2's) average over dp
        #    undoes the factor, and the window's count, not the microbatch's, is the denominator.
        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            s = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
            sums.append(float(s.detach()))
            return s * (size / total)

        window_sum = 0.0
        # 3. One schedule for the whole window, built once: a new schedule per step infers the stage's shapes again,
        #    and on FSDP2 stages that re-initialisation clears the gradients of the steps before (NeMo Automodel
        #    #3530). pipeline.batches cuts the window into STEPS batches of one shape (a short window's first steps
        #    hold only ignored rows, and still run on every stage).
        #    scale_grads=False: the loss is already divided by the window's count. torch's default (True) divides
        #    the gradients by M again at the end of every step, and over several steps it divides the earlier
        #    steps' gradients once more at each later step (torchtitan #1733).
        schedule = p.schedule(loss_fn, MICROBATCHES, scale_grads=False)
        for inputs, labels in p.batches(window, STEPS, MICROBATCHES):
            sums.clear()
            losses = p.step(schedule, inputs, labels)
            # The last stage's microbatch loss sums of this step (the schedule's first step also calls loss_fn
            # once on the placeholder it infers shapes from).
            window_sum += sum(sums[len(sums) - len(losses):]) if losses else 0.0
        # 4. The logged loss: the last stage's sum on every stage, summed over dp, over the count.
        local = torch.tensor(p.from_last(window_sum), dtype=torch.float64)
        if group is not None:
            dist.all_reduce(local, group=group)
        return float(local) / total


recipe = PipelineRecipe()
