"""Negative controls, world family. Mistakes that depend on the world size, so a run at the W the author tested passes:
a world-size factor written as the number 2, a token count reduced over the ranks of one node instead of every rank,
and a count averaged over the ranks (then "undone" with the factor that is right at W=2).

Each class declares where the battery rejects it (the world sizes where its mistake shows, and for the node-local
count a launch across nodes) and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it.
``tests/distributed/test_negative_controls.py`` shows each one passing where its author tested it, too."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.core.formats import supervised_tokens
from harness.core.loss import count_device
from harness.core.microbatch import Microbatch
from harness.recipes.catalog import TORCHRUN_NODES, Target, control
from harness.recipes.correct import _world_size, accumulate, window_count
from harness.recipes.helpers import require_tokens


@control(Target("parity", "uneven", world_sizes=(4,)), "global_scale")
class HardCodedWorldSize:
    """The correct recipe with the world-size factor written as ``2``, the W its author ran: ``loss_sum * 2 / N``.
    Right at W=2; at W=4 every token weighs 2/W = half its weight (at W=3, two thirds)."""

    name = "hard_coded_world_size"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total = window_count(window)
        accumulate(model, window, lambda s: s * 2 / total)
        return None


_NODE_GROUPS: dict[int, Any] = {}
"""This process's node-local group, by world size: created once (``new_group`` is collective: every rank must call it
for every group, in the same order)."""


def node_group() -> Any:
    """The process group of the ranks on this rank's node, from torchrun's ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``
    (consecutive ranks share a node); created on the first call of each world size."""
    world = dist.get_world_size()
    if world not in _NODE_GROUPS:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        node = int(os.environ.get("GROUP_RANK", dist.get_rank() // local))
        groups = [dist.new_group(list(range(g * local, (g + 1) * local))) for g in range(world // local)]
        _NODE_GROUPS[world] = groups[node]
    return _NODE_GROUPS[world]


@control(Target("parity", "uneven", world_sizes=(4,), launch=TORCHRUN_NODES), "subgroup_count")
class CountOverLocalRanks:
    """Counts the window's tokens with an all-reduce over the ranks of this node only (a group built from
    ``LOCAL_WORLD_SIZE``, as for an intra-node reduction), not over every data-parallel rank: each node's tokens are
    divided by that node's count. Right while every rank is on one node (every in-process run); on two nodes of two
    ranks each, every token weighs N / (its node's count) times its weight."""

    name = "count_over_local_ranks"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        local = sum(supervised_tokens(mb) for mb in window)
        count = torch.tensor(local, dtype=torch.int64, device=count_device())
        dist.all_reduce(count, group=node_group())
        total = require_tokens(int(count))
        world = _world_size()
        accumulate(model, window, lambda s: s * world / total)
        return None


@control(Target("parity", "uneven", world_sizes=(4,)), "global_scale")
class AveragedCount:
    """The count averaged over the ranks ("mean count": all-reduce SUM, divided by W), then multiplied by 2 "to undo
    it", as its author's W=2 run asked: ``2 * N / W`` in place of ``N``. Right at W=2; at W=4 every token weighs
    W/2 = twice its weight (at W=3, 1.5 times)."""

    name = "averaged_count"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        world = _world_size()
        mean_count = window_count(window) / world
        total = mean_count * 2
        accumulate(model, window, lambda s: s * world / total)
        return None
