"""Negative controls, pipeline family: mistakes of a recipe that drives a ``torch.distributed.pipelining`` schedule
over a mesh with pp (:mod:`harness.distributed.pipeline`).

``scale_grads`` left at torch's default with accumulation over several schedule steps (torchtitan #1733, "Gradient
accumulation broken in PP"): the schedule divides the gradients accumulated so far by the number of microbatches at the
end of every step, so a window of A steps keeps sum_a g_a / M^(A-1-a), an exponential moving average, not the sum.
Stages re-initialised between the steps of a window (NVIDIA-NeMo Automodel #3530): on FSDP2-sharded stages torch
clears the gradients, so only the last step's survives. The count reduced over the whole world (dp x pp) where the
token group (dp) belongs: the pp ranks hold the same tokens again. A loss already divided by the window's count left
at the default ``scale_grads=True``: divided by the microbatch count again. Each schedule microbatch's own token mean
divided by ``M x A`` (torchtitan #1732's first fix for #1733): a mean of the microbatches' means.
``harness.recipes:pipeline_token_mean`` is the recipe each is the wrong twin of.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from harness.core.microbatch import Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.pipelined import drive

MESH = "pp=2"


@control(Target("parity", "uneven", mesh=MESH), "pp_scale_grads")
class ScaleGradsWithAccumulation:
    """Accumulates the window over 2 schedule steps of 2 microbatches with ``scale_grads`` left True, its loss scaled
    by the microbatch count to undo the schedule's division (right for one step): the division at the end of the
    first step applies to its gradient again at the end of the second, so the first step's gradient is kept at 1/M
    (torchtitan #1733); the diagnosis names it by that formula over the recorded steps."""

    name = "pp_scale_grads_with_accumulation"
    n_microbatches = 2

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], pipeline: Any = None) -> float:
        m = self.n_microbatches
        return drive(pipeline, window, m, steps=2, scale_grads=True, loss_factor=float(m))


@control(Target("parity", "uneven", strategy="fsdp2", mesh="dp=2,pp=2"), "pp_last_step_only")
class ReinitialisedStages:
    """Accumulates the window over 2 schedule steps with the correct loss and ``scale_grads=False``, but builds a new
    schedule for each step, so the stage is initialised again (its shapes inferred with a forward and backward of its
    own) before the second: on FSDP2-sharded stages torch 2.13's cleanup after that inference sets every sharded
    parameter's ``.grad`` to None, so only the last step's gradient survives (NVIDIA-NeMo Automodel #3530). On DDP or
    unwrapped stages the gradients are kept, and the same recipe is right."""

    name = "pp_reinitialised_stages"
    n_microbatches = 2

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], pipeline: Any = None) -> float:
        return drive(pipeline, window, self.n_microbatches, steps=2, reinitialise=True)


@control(Target("parity", "uneven", mesh="dp=2,pp=2"), "count_group")
class CountOverWorld:
    """The correct recipe but for the count, all-reduced over the whole world (dp x pp) where the token group (dp)
    belongs: the pp ranks of a data coordinate hold its tokens again, so the count holds each pp times and every
    weight is 1/pp (0.5000 at dp=2,pp=2). The diagnosis names the group the count was reduced over."""

    name = "pp_count_over_world"
    n_microbatches = 2

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], pipeline: Any = None) -> float:
        return drive(pipeline, window, self.n_microbatches, count_group=dist.group.WORLD)


@control(Target("parity", "uneven", mesh=MESH), "pp_divided_by_microbatches")
class GlobalCountDefaultScaleGrads:
    """The correct loss, each microbatch's sum over the window's global count, in one schedule step per window, with
    ``scale_grads`` left at torch's default (True): the schedule divides the gradients by its 4 microbatches at the
    end of the step, where the loss was already divided by the count (torchtitan #1733's other half: the division
    belongs to one of the two). M=4, not 2, so that 1/M is not also 1/pp, a count over pp."""

    name = "pp_global_count_default_scale_grads"
    n_microbatches = 4

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], pipeline: Any = None) -> float:
        return drive(pipeline, window, self.n_microbatches, scale_grads=True)


@control(Target("parity", "uneven", mesh="dp=2,pp=2"), "pp_microbatch_means")
class MicrobatchMeansOverMTimesA:
    """torchtitan PR #1732's first fix for #1733: ``scale_grads=False`` and the window over A=2 steps of M=2, each
    schedule microbatch's loss its own token mean (its loss sum over its own supervised count) divided by M x A.
    Right when every schedule microbatch holds as many tokens; on uneven rows a token of schedule microbatch k weighs
    1/(n_k x M x A x dp) (DDP's average over dp) where 1/N belongs: a mean of the microbatches' means. The fix that
    landed counts the tokens over the window instead (:class:`harness.recipes.pipelined.PipelineTokenMean`)."""

    name = "pp_microbatch_means_over_m_times_a"
    n_microbatches = 2
    steps = 2

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], pipeline: Any = None) -> float:
        m, a = self.n_microbatches, self.steps
        return drive(pipeline, window, m, steps=a, microbatch_mean=True, loss_factor=1 / (m * a))
