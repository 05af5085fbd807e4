"""Negative controls, pipeline family: mistakes of a recipe that drives a ``torch.distributed.pipelining`` schedule
over a mesh with pp (:mod:`harness.distributed.pipeline`).

``scale_grads`` left at torch's default with accumulation over several schedule steps (torchtitan #1733, "Gradient
accumulation broken in PP"): the schedule divides the gradients accumulated so far by the number of microbatches at the
end of every step, so a window of A steps keeps sum_a g_a / M^(A-1-a), an exponential moving average, not the sum.
Stages re-initialised between the steps of a window (NVIDIA-NeMo Automodel #3530): on FSDP2-sharded stages torch
clears the gradients, so only the last step's survives.
``harness.recipes:pipeline_token_mean`` is the recipe each is the wrong twin of.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
