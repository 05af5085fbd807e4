"""Metrics across ranks: combine *counts*, divide once at the end.

Each rank sees only its shard, and shards differ in size (a filter, a final partial batch, a sampler without
padding). Accuracy over the whole evaluation set is ``sum_r correct_r / sum_r total_r``; averaging per-rank
accuracies weights every rank equally instead of every example. Seed 004: rank 0 scores 90 of 100 and rank 1 10 of
20; the true accuracy is 100 / 120 = 0.8333, the mean of the two accuracies 0.70.

The distributed functions all-reduce on :func:`harness.core.loss.count_device` (CPU for gloo, the current CUDA device
for NCCL) in float64, so counts up to 2**53 are exact; outside a process group a single process is the whole world.
The distributed negative control (all-reduced per-rank accuracies) and the rank body the tests launch live in
``tests/support/metrics_bodies.py``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
import torch.distributed as dist

from harness.core.loss import count_device


def _check_counts(correct: object, total: object, where: str = "") -> None:
    for name, value in (("correct", correct), ("total", total)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            msg = f"{name}{where}={value!r} must be a non-negative integer (a number of examples)"
            raise ValueError(msg)
    if correct > total:  # type: ignore[operator]
        msg = f"correct{where}={correct!r} exceeds total{where}={total!r}; pass counts of the same examples"
        raise ValueError(msg)


def accuracy(correct: int, total: int) -> float:
    """``correct / total``; a metric over zero examples is undefined, so ``total=0`` raises."""
    _check_counts(correct, total)
    if total == 0:
        msg = "total=0: accuracy over zero examples is undefined; combine counts across ranks before dividing"
        raise ValueError(msg)
    return correct / total


def combine_counts(counts: Sequence[tuple[int, int]]) -> float:
    """Global accuracy from per-rank ``(correct, total)`` pairs: sums first, one division (a rank may hold 0)."""
    for r, (c, t) in enumerate(counts):
        _check_counts(c, t, f"[rank {r}]")
    return accuracy(sum(c for c, _ in counts), sum(t for _, t in counts))


def mean_of_accuracies(counts: Sequence[tuple[int, int]]) -> float:
    """NEGATIVE CONTROL: the unweighted mean of per-rank accuracies (seed 004's 0.70 instead of 0.8333).

    Equal to :func:`combine_counts` only when every rank holds the same number of examples (or the same accuracy);
    a rank with no example makes it undefined (raises).
    """
    return sum(accuracy(c, t) for c, t in counts) / len(counts)


def global_counts(correct: int, total: int) -> tuple[int, int]:
    """All-reduce (SUM) this rank's ``(correct, total)``; every rank must call it, also with ``(0, 0)``."""
    _check_counts(correct, total)
    if not (dist.is_available() and dist.is_initialized()):
        return int(correct), int(total)
    # One collective for both numbers: ranks stay in step, and float64 holds integers exactly up to 2**53.
    t = torch.tensor([float(correct), float(total)], dtype=torch.float64, device=count_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t[0]), int(t[1])


def global_accuracy(correct: int, total: int) -> float:
    """Accuracy over every rank's examples, from all-reduced counts: the same number on every rank."""
    return accuracy(*global_counts(correct, total))


__all__ = [
    "accuracy",
    "combine_counts",
    "global_accuracy",
    "global_counts",
    "mean_of_accuracies",
]
