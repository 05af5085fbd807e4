"""Metrics across real ranks, for ``tests/distributed/test_metrics_distributed.py``: the rank body and the distributed
negative control (seed 004: 0.8333 from all-reduced counts, 0.70 from all-reduced per-rank accuracies).

The product's side is :mod:`harness.core.metrics` (:func:`~harness.core.metrics.global_accuracy` from all-reduced
counts). Ranks import this module as ``support.metrics_bodies`` (``tests/`` on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from harness.core.loss import count_device
from harness.core.metrics import accuracy, global_accuracy


def mean_of_rank_accuracies(correct: int, total: int) -> float:
    """NEGATIVE CONTROL, distributed: all-reduce each rank's accuracy and divide by the world size."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = accuracy(correct, total)
    if not dist.is_initialized():
        return local
    t = torch.tensor(local, dtype=torch.float64, device=count_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t) / world


def metrics_rank_body(per_rank: Sequence[tuple[int, int]]) -> dict[str, float]:
    """Rank body for :func:`harness.distributed.launcher.launch`: rank r holds ``per_rank[r]``; returns both
    combinations."""
    correct, total = per_rank[dist.get_rank()]
    out = {"from_counts": global_accuracy(correct, total)}
    if all(t > 0 for _, t in per_rank):
        out["mean_of_accuracies"] = mean_of_rank_accuracies(correct, total)
    return out


__all__ = ["mean_of_rank_accuracies", "metrics_rank_body"]
