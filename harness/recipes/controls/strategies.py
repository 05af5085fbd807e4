"""Negative controls, strategy family. Mistakes in how a recipe meets its data-parallel strategy: FSDP2 synchronizing
every microbatch, FSDP2's divisor knobs set on the root module only, a loss written for a summing reduction run
under the default average, and one strategy's way to skip a synchronization used under the other.

Each class declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from harness.core.loss import global_token_loss, loss_sum
from harness.core.microbatch import Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.correct import _world_size, accumulate, global_sum, window_count


@control(Target("one_sync", "uneven", strategy="fsdp2"), "correct")
class Fsdp2SyncEveryMicrobatch:
    """An FSDP2 loop that never calls ``set_requires_gradient_sync(False)``: every microbatch reduce-scatters. The
    gradients are right (FSDP2 adds the reduced shards), so parity cannot see it; only the count can."""

    name = "fsdp2_sync_every_microbatch"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        for mb in window:
            global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
        return None


@control(Target("parity", "uneven", strategy="fsdp2"), "global_scale")
class DivideFactorOnRootOnly:
    """A loss written for a summing reduction (the global count, no world-size factor) that asks FSDP2 to sum by
    setting the divisor knobs on the root module only: the setters do not recurse, so every group below the root
    still averages, and its gradients are 1/W of the truth while the root's own parameters are right (the built-in
    model's root owns none: every gradient is 1/W, and the verdict names the knobs that differ)."""

    name = "divide_factor_on_root_only"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        model.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        model.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        total = window_count(window)
        return global_sum(accumulate(model, window, lambda s: s / total)) / total


@control(Target("parity", "uneven", strategy="fsdp2"), "global_scale")
class SumLossUnderAveraging:
    """torchtitan's loss (the global count, no world-size factor) without declaring the summing reduction it is
    written for: under the default average every gradient is 1/W of the truth."""

    name = "sum_loss_under_averaging"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total = window_count(window)
        return global_sum(accumulate(model, window, lambda s: s / total)) / total


@control(Target("parity", "uneven", shows_as="usage", strategy="fsdp2"), None)
class DdpNoSyncUnderFsdp2:
    """A DDP loop run under FSDP2: ``model.no_sync()`` does not exist on a ``fully_shard`` model."""

    name = "ddp_no_sync_under_fsdp2"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        for i, mb in enumerate(window):
            if i < len(window) - 1:
                with model.no_sync():  # type: ignore[operator]
                    global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
            else:
                global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
        return None


@control(Target("parity", "uneven", shows_as="usage"), None)
class Fsdp2NoSyncUnderDdp:
    """An FSDP2 loop run under DDP: ``set_requires_gradient_sync`` does not exist on a DDP model."""

    name = "fsdp2_no_sync_under_ddp"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        for i, mb in enumerate(window):
            model.set_requires_gradient_sync(i == len(window) - 1)  # type: ignore[operator]
            global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
        return None
