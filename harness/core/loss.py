"""The loss pieces, and the one place where the denominator is computed.

The objective is the mean over every supervised token of the global accumulation window:
``L = (sum_r S_r) / N`` with ``S_r`` rank r's loss sum and ``N`` the global supervised count.
DDP *averages* gradients over W ranks, so each rank backpropagates ``W * S_r / N``: the factor W cancels
DDP's division by W, and ``N`` (all-reduced before any backward) is the same on every rank.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.core.microbatch import IGNORE_INDEX
from harness.core.validate import positive_int


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy over supervised positions (``labels != IGNORE_INDEX``).

    A sum, not a mean: zero supervised tokens give 0 with zero gradients (a mean would give NaN), and the
    normalization is left to the one global denominator.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        msg = f"logits must be [B, T, V] and labels [B, T]; got {tuple(logits.shape)} and {tuple(labels.shape)}"
        raise ValueError(msg)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def supervised_count(labels: torch.Tensor) -> int:
    """Positions that enter the loss; padding and prompt positions never do."""
    return int((labels != IGNORE_INDEX).sum())


def count_device() -> torch.device:
    """Where a collective on a count tensor must live for the default group's backend."""
    backend = str(dist.get_backend())
    # A pure NCCL group only reduces CUDA tensors; gloo, or "cpu:gloo,cuda:nccl", takes CPU tensors.
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_count(local_count: int, device: torch.device | str | None = None, group: Any = None) -> int:
    """All-reduce (SUM) this rank's supervised count; every rank gets the same total.

    Every rank must call it, in the same order relative to other collectives, even with a count of 0.
    Without an initialized process group it returns ``local_count`` (a single process is the whole world).
    ``group``: the process group to sum over (None: every rank); on a mesh, the one
    :func:`harness.recipes.helpers.token_group` names.
    """
    if isinstance(local_count, bool) or not isinstance(local_count, numbers.Integral) or local_count < 0:
        msg = f"local_count={local_count!r} must be a non-negative integer (a number of supervised tokens)"
        raise ValueError(msg)
    if not (dist.is_available() and dist.is_initialized()):
        return int(local_count)
    count = torch.tensor(int(local_count), dtype=torch.int64, device=device or count_device())
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return int(count)


def global_token_loss(local_sum: torch.Tensor, global_count: int, world_size: int) -> torch.Tensor:
    """``local_sum * world_size / global_count``: the scalar whose DDP-averaged gradient is the global token mean's.

    Raises ``ValueError`` when ``global_count <= 0``: a mean over zero tokens is undefined, and every rank sees the
    same count, so every rank raises together and none is left waiting in a collective.
    """
    positive_int("world_size", world_size, "the number of ranks DDP averages over")
    check_global_count(global_count)
    return local_sum * (world_size / global_count)


def token_mean(sums: Sequence[Any], counts: Sequence[int]) -> Any:
    """The objective: every unit's (rank's or microbatch's) loss sum over the total supervised count. Plain arithmetic
    on whatever numbers come in (floats, Fractions, tensors), so the seeds' worked cases run through it."""
    _check_units(sums, counts)
    total = sum(counts)
    check_global_count(total)
    return sum(sums[1:], sums[0]) / total


def mean_of_means(sums: Sequence[Any], counts: Sequence[int]) -> Any:
    """The mistake: each unit's own mean, averaged over units, which is what DDP's gradient averaging makes of ranks
    that each divide by their local count. Equal to :func:`token_mean` only when counts (or local means) are equal."""
    _check_units(sums, counts)
    if any(c <= 0 for c in counts):
        msg = f"counts={list(counts)!r}: a unit without supervised tokens has no mean (the mean of means is undefined)"
        raise ValueError(msg)
    means = [s / c for s, c in zip(sums, counts)]
    return sum(means[1:], means[0]) / len(means)


def _check_units(sums: Sequence[Any], counts: Sequence[int]) -> None:
    if len(sums) != len(counts) or not counts:
        msg = f"sums ({len(sums)}) and counts ({len(counts)}) must pair one loss sum with one count per unit"
        raise ValueError(msg)


def check_global_count(global_count: int) -> None:
    """Raise ``ValueError`` unless the window holds at least one supervised token somewhere."""
    if global_count <= 0:
        msg = (
            f"global_count={global_count!r}: no supervised token in the global accumulation window; "
            "all ranks must skip or stop together"
        )
        raise ValueError(msg)
