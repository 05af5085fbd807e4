"""bf16 training steps written the way users write them (torch only): the step enters ``torch.autocast`` itself, as
real bf16 loops do, and skips the synchronization the way its strategy wants (``no_sync()`` under DDP,
``set_requires_gradient_sync`` under FSDP2), so one recipe runs under either. ``--precision bf16`` must judge them by
the bound derived from the correct computation's noise, in every scenario and on every drawn layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100


def _logits(out: Any) -> torch.Tensor:
    """A user's model may return an output object with ``.logits`` (``--model``)."""
    return out if isinstance(out, torch.Tensor) else out.logits


@contextlib.contextmanager
def _sync(model: torch.nn.Module, last: bool) -> Iterator[None]:
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last)
        yield
    elif last:
        yield
    else:
        with model.no_sync():  # type: ignore[operator]
            yield


def _step(model: torch.nn.Module, window: Sequence[Any], *, own_count: bool) -> float:
    world = dist.get_world_size()
    device = next(model.parameters()).device
    mine = sum(int((mb.labels != IGNORE).sum()) for mb in window)
    count = torch.tensor([mine])
    dist.all_reduce(count)
    total = int(count)
    if total == 0:
        raise ValueError("no supervised token in this window on any rank")
    # The mistake: each rank divides by its own count (a rank without tokens by 1), a mean of local means.
    divisor = max(mine, 1) if own_count else total / world
    local = 0.0
    for i, mb in enumerate(window):
        with _sync(model, i == len(window) - 1), torch.autocast(device.type, dtype=torch.bfloat16):
            logits = _logits(model(mb.inputs))
            s = F.cross_entropy(logits.float().flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE,
                                reduction="sum")
            (s / divisor).backward()
        local += float(s.detach())
    logged = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(logged)
    return float(logged) / total


class AutocastTokenMean:
    """Right: loss sums over the all-reduced count (times W for the strategy's average), under autocast."""

    name = "autocast_token_mean"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> float:
        return _step(model, window, own_count=False)


class AutocastMeanOfLocalMeans:
    """Wrong: the same step dividing by this rank's own count, a mean of local means."""

    name = "autocast_mean_of_local_means"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> float:
        return _step(model, window, own_count=True)
