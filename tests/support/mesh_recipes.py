"""Recipes for a dp x cp mesh written as a user of one writes them (test-only): the count reduced over the data-parallel
group alone, the bug of verl #5983, and its fix. Both build their groups from a cp size they are configured with, as a
training script reads it from its config."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.recipes.correct import accumulate

CP = 2
"""The cp size these recipes are written for (ranks r*CP .. r*CP+CP-1 share a data coordinate)."""


class CountOverDataParallelOnly:
    """Counts its window's tokens over the dp group only: under cp each rank holds a chunk of the positions, so the
    count misses the other chunks' tokens and the loss is about CP times too large (exactly CP when the chunks hold
    equal counts)."""

    name = "count_over_dp_only"

    def setup(self) -> None:
        world = dist.get_world_size()
        self.groups = [dist.new_group([d * CP + c for d in range(world // CP)]) for c in range(CP)]

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        count = torch.tensor(float(sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in window)), dtype=torch.float64)
        dist.all_reduce(count, group=self.groups[dist.get_rank() % CP])
        if count == 0:
            raise ValueError("no supervised token in the window")
        world = dist.get_world_size()
        accumulate(model, window, lambda s: s * world / float(count))
        return None
