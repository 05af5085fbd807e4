"""Negative controls, accumulation family. How microbatches are accumulated: loops written for a fixed number of
microbatches, and a microbatch counted twice.

Each class declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from harness.core.loss import check_global_count, global_count, global_token_loss, loss_sum
from harness.core.microbatch import Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.correct import _world_size, accumulate, window_count


@control(Target("parity", "long"), "dropped")
class TwoMicrobatchLoop:
    """Written for windows of exactly two microbatches: the first under ``no_sync()``, then the last. Right at k=2;
    a one-microbatch window counts its only microbatch twice, and a longer one drops the middle."""

    name = "two_microbatch_loop"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        first, last = window[0], window[-1]
        with model.no_sync():  # type: ignore[operator]
            global_token_loss(loss_sum(model(first.inputs), first.labels), total, world).backward()
        global_token_loss(loss_sum(model(last.inputs), last.labels), total, world).backward()
        return None


@control(Target("parity", "long"), "dropped", only_its_scenario=True)
class FixedAccumulationSteps:
    """Loops over ``range(accumulation_steps)`` from its own configuration (4) instead of over the window: a window
    of five microbatches loses its fifth, silently."""

    name = "fixed_accumulation_steps"
    accumulation_steps = 4

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        used = [mb for _, mb in zip(range(self.accumulation_steps), window)]
        total = global_count(sum(mb.supervised for mb in used))
        check_global_count(total)
        accumulate(model, used, lambda s: global_token_loss(s, total, _world_size()))
        return None


@control(Target("parity", "uneven"), "double_counted")
class LastMicrobatchTwice:
    """Runs every microbatch inside ``no_sync()``, then runs the last one again outside it to get the one
    synchronization: the count of synchronizations is right, and the last microbatch's tokens count twice."""

    name = "last_microbatch_twice"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        with model.no_sync():  # type: ignore[operator]
            for mb in window:
                global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
        last = window[-1]
        global_token_loss(loss_sum(model(last.inputs), last.labels), total, world).backward()
        return None
