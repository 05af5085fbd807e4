"""A recipe that crashes on one rank: the battery must name the rank and keep the exception line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class CrashesOnRankOne:
    name = "crashes_on_rank_one"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        if dist.get_rank() == 1:
            raise KeyError("labels")  # a batch key this rank's loader did not produce
        model(window[0].inputs).sum().backward()
