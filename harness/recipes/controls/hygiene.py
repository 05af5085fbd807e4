"""Negative controls, hygiene family. What a step must leave alone: the random generators, the logged loss (the
global token mean, not this rank's), and the weights themselves.

Each class declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from harness.core.formats import logits_of
from harness.core.loss import global_token_loss, loss_sum
from harness.core.microbatch import Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.correct import GlobalTokenMean, _sync_last, _world_size, accumulate, window_count


@control(Target("logged_loss", "uneven"), "correct")
class LocalLoggedLoss:
    """Right gradients, but logs this rank's own token mean: the logged loss differs between ranks."""

    name = "local_logged_loss"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return local / max(sum(mb.supervised for mb in window), 1)


@control(Target("hygiene", "uneven"), "correct")
class PythonRandomShuffle:
    """Shuffles the microbatch order with Python's global ``random``: the gradient is unchanged, but the caller's
    random stream (its data order, its augmentation) is not."""

    name = "python_random_shuffle"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        order = list(window)
        random.shuffle(order)
        total = window_count(order)
        accumulate(model, order, lambda s: global_token_loss(s, total, _world_size()))
        return None


@control(Target("hygiene", "uneven"), "correct")
class NumpyRandomDraw:
    """Draws a keep mask from numpy's global generator (and ignores it): the caller's numpy stream moves."""

    name = "numpy_random_draw"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        np.random.rand(len(window))
        return GlobalTokenMean().backward_window(model, window)


@control(Target("hygiene", "uneven"), "correct")
class TorchRandomDraw:
    """Permutes the microbatches with ``torch.randperm`` on the global generator: the caller's torch stream moves."""

    name = "torch_random_draw"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        order = [window[int(i)] for i in torch.randperm(len(window))]
        return GlobalTokenMean().backward_window(model, order)


WEIGHT_DECAY = 0.01
"""The decoupled weight decay the two weight-editing controls apply (times the harness's SGD rate, 0.1)."""


def _decay_weights(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 - 0.1 * WEIGHT_DECAY)


@control(Target("weights_unchanged", "uneven"), "weights_edited")
class WeightDecayAfterBackward:
    """The correct window, then decoupled weight decay applied in place (``p.mul_(1 - lr * wd)``), as a training
    step written as one function does before ``optimizer.step()``. The gradient is right; the weights the optimizer
    steps from are not the ones it was taken at, and the next window starts elsewhere."""

    name = "weight_decay_after_backward"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world))
        _decay_weights(model)
        return None


@control(Target("weights_unchanged", "uneven"), "weights_edited")
class WeightDecayBetweenMicrobatches:
    """Weight decay applied in place after every microbatch's backward (an accumulation loop that decays as if each
    microbatch were a step): every microbatch after the first is differentiated at other weights."""

    name = "weight_decay_between_microbatches"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                global_token_loss(loss_sum(logits_of(model(mb.inputs)), mb.labels), total, world).backward()
            _decay_weights(model)
        return None
