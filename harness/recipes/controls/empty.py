"""Negative controls, empty family. Windows, ranks and microbatches without any supervised token: a rank that skips
its backward (a desync), or only its empty last microbatch's (a desync that gloo aborts inside the window), a guard on
the local count, NaN from 0/0 on a rank, a microbatch or the whole window, a raise on some ranks only.

Each class declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from harness.core.loss import check_global_count, count_device, global_count, global_token_loss
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.correct import _sync_last, _world_size, accumulate, forward_loss_sum, global_sum, window_count


@control(Target("parity", "one_empty", shows_as="desync"), None)
class SkipBackwardWhenEmpty:
    """A rank with no supervised token returns without forward or backward: its peers wait in DDP's all-reduce
    (or, worse, pair with its next collective of the same size)."""

    name = "skip_backward_when_empty"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        if sum(mb.supervised for mb in window) == 0:
            return None
        accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return None


@control(Target("parity", "one_empty", shows_as="desync"), None)
class LocalCountGuard:
    """Guards the empty window with this rank's own count: a rank without tokens raises ValueError and leaves, while
    its peers, whose count is not zero, wait in DDP's all-reduce for it (the guard must use the global count)."""

    name = "local_count_guard"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        if sum(mb.supervised for mb in window) == 0:
            msg = "no supervised token in this window"
            raise ValueError(msg)
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return None


@control(Target("parity", "sparse", shows_as="desync"), None)
class SkipBackwardOfEmptyMicrobatch:
    """Runs every microbatch's forward and skips the backward of one without a supervised token, a per-rank
    ``continue`` (DFlash's trainer in NeMo Automodel, fixed by NVIDIA-NeMo/Automodel#2468). Harmless under
    ``no_sync()``; on the last microbatch, the one that synchronizes, the rank skips DDP's all-reduce, and its next
    collective (the logged loss's one-float all-reduce) meets its peers' gradient all-reduce: gloo aborts on the size
    mismatch (NCCL's watchdog, or a timeout, elsewhere) inside the window, before any rank has finished it."""

    name = "skip_backward_of_empty_microbatch"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        local = 0.0
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                s = forward_loss_sum(model, mb)
                if mb.supervised == 0:
                    continue  # the mistake: this rank's decision alone, and the last backward carries the all-reduce
                global_token_loss(s, total, world).backward()
            local += float(s.detach())
        return global_sum(local) / total


def _masked_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood masked by *multiplication*, as hand-written losses (RL, preference tuning)
    often do: gather the target's log-probability, then ``* mask``. Right where a denominator is non-zero; divided by
    zero, the masked positions' ``0 * inf`` turns every gradient into NaN (``F.cross_entropy`` with ``ignore_index``
    would have zeroed them instead)."""
    mask = (labels != IGNORE_INDEX).to(logits.dtype)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -logp * mask


@control(Target("parity", "one_empty"), "nonfinite", only_its_scenario=True)
class NanOnEmptyRank:
    """Takes this rank's masked token mean and rescales it by ``local * W / N``: the correct gradient, except on a rank
    without supervised tokens, where the mean divides by zero and DDP spreads the NaN gradient to every rank."""

    name = "nan_on_empty_rank"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        local = sum(mb.supervised for mb in window)
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                logits = model(mb.inputs)
                rank_mean = _masked_token_losses(logits, mb.labels).sum() / torch.tensor(float(local))
                (rank_mean * (local * world / total)).backward()
        return None


@control(Target("parity", "sparse"), "nonfinite", only_its_scenario=True)
class NanOnEmptyMicrobatch:
    """Guards a rank without tokens, but not a microbatch without tokens: each microbatch's masked mean (0/0 over no
    token) is rescaled by its count, and its NaN gradient reaches every weight."""

    name = "nan_on_empty_microbatch"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        local = sum(mb.supervised for mb in window)
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                logits = model(mb.inputs)
                if local == 0:
                    loss = logits.sum() * 0.0  # the rank-level guard: keeps the backward (and DDP's sync) going
                else:
                    mean = _masked_token_losses(logits, mb.labels).sum() / torch.tensor(float(mb.supervised))
                    loss = mean * (mb.supervised * world / total)
                loss.backward()
        return None


def _masked_backward(model: nn.Module, window: Sequence[Microbatch]) -> torch.Tensor:
    """Forward and backward of every microbatch with its masked token loss sum divided by the window's count, an
    all-reduced tensor, with no guard: right on every window with a token; on one without any, ``0 / 0`` is NaN and
    its backward ``0 * inf`` puts NaN in every gradient. Returns the count."""
    count = torch.tensor(float(sum(mb.supervised for mb in window)), dtype=torch.float64, device=count_device())
    if dist.is_initialized():
        dist.all_reduce(count)
    world = _world_size()
    for i, mb in enumerate(window):
        with _sync_last(model, i, len(window)):
            logits = model(mb.inputs)
            s = _masked_token_losses(logits, mb.labels).sum()
            (s * world / count.to(s.device, s.dtype)).backward()
    return count


@control(Target("empty_window", "all_empty"), None, only_its_scenario=True)
class NanOnEmptyWindow:
    """Divides its masked token loss sum by the all-reduced count and never looks at it: right on every window with a
    token; on a window without any, the 0/0 leaves NaN in every gradient on every rank, which a training loop would
    step its optimizer on (zeroing ignored positions by multiplication, then dividing by zero)."""

    name = "nan_on_empty_window"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        _masked_backward(model, window)
        return None


@control(Target("empty_window", "all_empty"), None)
class NanGradientsThenRaise:
    """Backpropagates first and checks the count after: its masked token loss is divided by the all-reduced count
    tensor, which is right on every window with tokens; on a window without any it raises the contract's ValueError,
    but only after 0/0 has left NaN in ``.grad`` for the next window to add to."""

    name = "nan_gradients_then_raise"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        check_global_count(int(_masked_backward(model, window)))
        return None


@control(Target("empty_window", "all_empty"), None)
class RaiseOnRankZeroOnly:
    """Checks the global count on the main process only, where the loop logs: on a window without any supervised
    token rank 0 raises ValueError while every other rank skips the window and returns, so the ranks go on
    differently (right at W=1, where rank 0 is every rank; every window with a token is the correct recipe's)."""

    name = "raise_on_rank_zero_only"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = global_count(sum(mb.supervised for mb in window)), _world_size()
        if total == 0:
            if not dist.is_initialized() or dist.get_rank() == 0:
                check_global_count(total)
            return None
        accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return None
