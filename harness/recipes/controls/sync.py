"""Negative controls, sync family. When gradients synchronize: never inside ``no_sync()``, a sync keyed to the wrong
microbatch, a one-microbatch window that never synchronizes.

Each class declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from torch import nn

from harness.core.loss import global_token_loss, loss_sum
from harness.core.microbatch import Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.correct import _world_size, accumulate, window_count


@control(Target("one_sync", "uneven"), "correct")
class NeverNoSync:
    """Right numbers, but every microbatch synchronizes: W-1 extra all-reduces of every gradient per window.
    Parity cannot see it (its gradients pass: ``test_never_using_no_sync_is_invisible_to_parity``); only the
    synchronization count can."""

    name = "never_no_sync"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world), sync_every_microbatch=True)
        return None


@control(Target("one_sync", "long"), "correct")
class SyncKeyedToFirstMicrobatch:
    """Enters ``no_sync()`` for "the first microbatch" instead of "all but the last": k-1 synchronizations, which is
    the right count only when k=2 (k=1 never synchronizes at all)."""

    name = "sync_keyed_to_first_microbatch"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        for i, mb in enumerate(window):
            with model.no_sync() if i == 0 else contextlib.nullcontext():  # type: ignore[operator]
                global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
        return None


@control(Target("one_sync", "single"), "not_synchronized", only_its_scenario=True)
class FirstMicrobatchNeverSyncs:
    """Decides "first microbatch: enter no_sync" before "last microbatch: synchronize": right for every window of two
    or more, but a one-microbatch window (a short final window) never synchronizes its gradients."""

    name = "first_microbatch_never_syncs"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        for i, mb in enumerate(window):
            if i == 0:
                ctx = model.no_sync()  # type: ignore[operator]
            elif i == len(window) - 1:
                ctx = contextlib.nullcontext()
            else:
                ctx = model.no_sync()  # type: ignore[operator]
            with ctx:
                global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
        return None
