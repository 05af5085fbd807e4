"""Recipes slower than the battery's deadline allows, as a first ``torch.compile`` or a cold cache is: the verdict
must say where the time ran out and how to give the run more."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from user_recipes.variants import _accumulate, _count


class SlowWindow:
    """Sleeps ``seconds`` in window ``slow`` (0: the first) on every rank; the right gradient otherwise."""

    name = "slow_window"

    def __init__(self, slow: int = 0, seconds: float = 60.0) -> None:
        self.slow = slow
        self.seconds = seconds
        self.windows = 0

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        if self.windows == self.slow:
            time.sleep(self.seconds)
        self.windows += 1
        _accumulate(model, window, _count(window))


first_window = SlowWindow(0)
second_window = SlowWindow(1)
