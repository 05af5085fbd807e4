"""Training steps whose gradient is right and whose logged loss is weighted wrongly, written the way users write them
(torch only): the mean of the ranks' means, the mean of the microbatches' means, the mean of the sequences' means.
Each logs the same number on every rank, so only the logged-loss check's comparison with the global token mean at
the window's weights can see it, and only where per-token losses differ (``harness.battery.prepare.start``)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100


def _logits(out: Any) -> torch.Tensor:
    """A user's model may return an output object with ``.logits`` (``--model``)."""
    return out if isinstance(out, torch.Tensor) else out.logits


def _all_sum(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return [float(v) for v in t]


def _step(model: torch.nn.Module, window: Sequence[Any]) -> list[torch.Tensor]:
    """The correct gradient (loss sums over the all-reduced count, times W for DDP's average); returns each
    microbatch's per-token losses (supervised positions only, ``[rows, positions]`` with NaN elsewhere)."""
    world = dist.get_world_size()
    count = torch.tensor([sum(int((mb.labels != IGNORE).sum()) for mb in window)])
    dist.all_reduce(count)
    total = int(count)
    if total == 0:
        raise ValueError("no supervised token in this window on any rank")
    losses = []
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():  # type: ignore[operator]
            logits = _logits(model(mb.inputs))
            per = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE,
                                  reduction="none").view(mb.labels.shape)
            (per.sum() * world / total).backward()
        losses.append(per.detach().masked_fill(mb.labels == IGNORE, float("nan")))
    return losses


class LoggedMeanOfLocalMeans:
    """Logs the mean over ranks of each rank's own token mean (a rank without tokens counting 0)."""

    name = "logged_mean_of_local_means"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> float:
        per = torch.cat([x.flatten() for x in _step(model, window)])
        kept = per[~per.isnan()]
        mine = float(kept.mean()) if kept.numel() else 0.0
        return _all_sum(mine)[0] / dist.get_world_size()


class LoggedMicrobatchMean:
    """Logs the mean over every rank's microbatches of each microbatch's token mean (empty ones left out): what
    averaging the per-step losses of a gradient-accumulation loop logs."""

    name = "logged_microbatch_mean"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> float:
        means = [x[~x.isnan()].mean() for x in _step(model, window) if (~x.isnan()).any()]
        total, n = _all_sum(float(sum(means)) if means else 0.0, float(len(means)))
        return total / n


class LoggedSequenceMean:
    """Logs the mean over every supervised sequence of its own token mean: short sequences weigh as much as long
    ones."""

    name = "logged_sequence_mean"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> float:
        rows = [row[~row.isnan()] for x in _step(model, window) for row in x]
        means = [r.mean() for r in rows if r.numel()]
        total, n = _all_sum(float(sum(means)) if means else 0.0, float(len(means)))
        return total / n


class LoggedGlobalTokenMean:
    """The same step logging the global token mean: the logged-loss check's positive control."""

    name = "logged_global_token_mean"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> float:
        per = torch.cat([x.flatten() for x in _step(model, window)])
        kept = per[~per.isnan()]
        total, n = _all_sum(float(kept.sum()), float(kept.numel()))
        return total / n
