"""Recipes for a device mesh written as users of one write them (test-only), each taking the ``mesh`` the harness
passes: the count all-reduced over the data-parallel dimension alone, the bug of verl #5983 (and, with each shard's
own count, Megatron-LM #7513); under HSDP, the fix of a clipping norm summed over the replicas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.recipes.controls.hsdp import NormOverReplicas
from harness.recipes.correct import accumulate
from harness.recipes.helpers import shard_group


def _local_count(window: Sequence[Microbatch]) -> torch.Tensor:
    return torch.tensor(float(sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in window)), dtype=torch.float64)


class CountOverDataParallelOnly:
    """Counts its window's tokens over ``mesh["dp"]`` only: under cp each rank holds a chunk of the positions, so the
    count misses the other chunks' tokens and the loss is about cp times too large (exactly cp when the chunks hold
    equal counts). Right on a mesh without cp, where dp is every rank."""

    name = "count_over_dp_only"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        count = _local_count(window)
        dist.all_reduce(count, group=mesh["dp"].get_group())
        if count == 0:
            raise ValueError("no supervised token in the window")
        size = dist.get_world_size()
        accumulate(model, window, lambda s: s * size / float(count))
        return None


class NormOverShardGroup(NormOverReplicas):
    """VeOmni's fix (PR #862) of ``harness.recipes:norm_over_replicas``: the same hand-written norm, its squared shard
    norms summed over the shard group only (each replica holds every shard once), so it is the global norm."""

    name = "norm_over_shard_group"

    def norm_group(self, mesh: Any) -> Any:
        return shard_group(mesh)
