"""Empty-window policies as real loops have them (launched by ``tests/distributed/test_empty_window.py``): the
Trainer's 0/0 loss beside zero gradients, and a loop that waits forever for a window with tokens."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import IGNORE_INDEX, Microbatch
from harness.core.loss import count_device


class NanLossZeroGradients:
    """The loss as transformers' Trainer computes it with ``average_tokens_across_devices=True``: each microbatch's
    cross-entropy sum divided by the all-reduced count tensor, times W, no guard. On a window without any supervised
    token the loss is 0/0 = NaN and every gradient is zero (cross-entropy gives ignored positions none); it returns
    the NaN it logged."""

    name = "nan_loss_zero_gradients"
    accumulate = True
    """All but the last microbatch under ``no_sync()``; False: every backward synchronizes (a one-rank loop's way)."""

    def backward_window(self, model: torch.nn.Module, window: Sequence[Microbatch]) -> torch.Tensor:
        count = torch.tensor(sum(mb.supervised for mb in window), dtype=torch.int64, device=count_device())
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dist.is_initialized():
            dist.all_reduce(count)
        logged = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last or not self.accumulate else model.no_sync():  # type: ignore[operator]
                logits = model(mb.inputs)
                s = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
                loss = s / count.to(s.device) * world
                loss.backward()
            logged += loss.detach().double()
        if dist.is_initialized():
            dist.all_reduce(logged)
        return logged / world


class NanLossSyncedEveryMicrobatch(NanLossZeroGradients):
    """The same loss with every backward synchronized (no ``no_sync()``): on a model with a parameter no forward
    reaches, each forward after the first needs DDP's ``find_unused_parameters``, on an empty window as on any."""

    name = "nan_loss_synced_every_microbatch"
    accumulate = False


class WaitsForTokens:
    """On a window without any supervised token every rank waits for a batch that never comes (as a loop that polls
    its data pipeline for one with tokens): a hang the run's deadline must end; the correct recipe otherwise."""

    name = "waits_for_tokens"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Microbatch]) -> float | None:
        from harness.recipes import global_token_mean

        if not any(mb.supervised for mb in window):
            threading.Event().wait()
        return global_token_mean.backward_window(model, window)
