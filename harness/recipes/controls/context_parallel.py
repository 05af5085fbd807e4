"""Negative controls, context-parallel family. Counts reduced over the wrong group of a dp x cp mesh, as the public
record has them: the count all-reduced over dp alone while DDP averages over dp x cp (verl #5983, #6049), each cp
shard dividing by its own count (Megatron-LM #7513, #673), the count and the data-parallel size both taken from dp
(right while the shards hold equal counts), a rank that skips its backward when its own shard holds no token, and a
router's auxiliary loss scaled for the token group where the data-parallel one belongs (Megatron-LM #5047, #3768),
and a sequence mean whose chunks divide by their own counts of a sequence's tokens.

Every one is right on ``dp=W`` (the world is one data-parallel group there); each declares the mesh its mistake shows
on (``Target(mesh=...)``) and what the diagnosis reads in its gradient (``@control``, :mod:`harness.recipes.catalog`);
``harness.recipes:<name>`` names it, and ``mesh_token_mean`` is the recipe each is the wrong twin of
(``harness.recipes.objectives:mesh_token_mean_with_load_balance`` the auxiliary one's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.core.formats import supervised_tokens
from harness.core.loss import count_device, global_token_loss
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.correct import accumulate
from harness.recipes.helpers import require_tokens, token_group, token_group_size
from harness.recipes.objectives import MeshTokenMeanWithLoadBalance, SequenceMean, data_microbatches

MESH = "dp=2,cp=2"


def _count_over(window: Sequence[Microbatch], group: Any) -> int:
    count = torch.tensor(sum(supervised_tokens(mb) for mb in window), dtype=torch.int64, device=count_device())
    dist.all_reduce(count, group=group)
    return int(count)


def _dp_group(mesh: Any) -> Any:
    """The data-parallel dimension's group alone (``mesh["dp"]``), as a recipe written before cp existed reaches it."""
    return mesh["dp"].get_group()


@control(Target("parity", "uneven", mesh=MESH), "count_group")
class CountOverDataParallelOnly:
    """Counts the window's tokens over ``mesh["dp"]`` only, and scales by the token group's size as it should (verl
    #5983): under cp each rank holds a chunk of the positions, so the count misses the other chunks' tokens, and
    each chunk's tokens weigh ``N / N_dp(chunk)``, about cp times too much (exactly cp where the chunks hold equal
    counts). Right on a mesh without cp."""

    name = "count_over_dp_only"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        total = require_tokens(_count_over(window, _dp_group(mesh)))
        size = token_group_size(mesh)
        accumulate(model, window, lambda s: global_token_loss(s, total, size))
        return None


@control(Target("parity", "uneven", mesh=MESH), "count_group")
class OwnShardCount:
    """Each cp shard divides its loss sum by its own supervised count, never reduced (Megatron-LM #7513): the
    gradients' average over dp x cp then makes a mean of the shards' local means. Invisible where the shards hold
    equal counts; a shard without tokens divides 0 by 0."""

    name = "own_shard_count"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        own = sum(supervised_tokens(mb) for mb in window)
        accumulate(model, window, lambda s: s / own if own else s * float("nan"))
        return None


@control(Target("parity", "uneven", mesh=MESH), "count_group")
class CountAndSizeFromDataParallel:
    """Takes the count and the factor both from ``mesh["dp"]``: ``loss_sum * dp / N_dp``. On balanced shards the two
    mistakes cancel (``N_dp = N / cp`` and ``dp = T / cp``); where the chunks' counts differ, each chunk's tokens weigh
    ``N / (cp * N_dp(chunk))``."""

    name = "count_and_size_from_dp"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        total = require_tokens(_count_over(window, _dp_group(mesh)))
        size = int(mesh["dp"].size())
        accumulate(model, window, lambda s: global_token_loss(s, total, size))
        return None


@control(Target("parity", "empty_shard", mesh=MESH, shows_as="desync"), None)
class SkipBackwardOnEmptyShard:
    """Counts right, but a rank whose own cp shard holds no supervised token returns before its backward, as a guard
    written for a data-parallel rank with no tokens does: its dp x cp peers wait in the gradient's all-reduce."""

    name = "skip_backward_on_empty_shard"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        total = require_tokens(_count_over(window, token_group(mesh)))
        if sum(supervised_tokens(mb) for mb in window) == 0:
            return None
        size = token_group_size(mesh)
        accumulate(model, window, lambda s: global_token_loss(s, total, size))
        return None


@control(Target("parity", "uneven", mesh=MESH), "auxiliary_misweighted")
class AuxScaledForTokenGroup(MeshTokenMeanWithLoadBalance):
    """The load-balancing term (one value per microbatch) scaled like the main loss, by the token group's size over
    the microbatch count (``dp * cp / M``), where its own unit's group is dp (``dp / M``): every cp rank of a data
    coordinate holds the same value of a microbatch's term, and the gradients' average over dp x cp then keeps cp
    copies of it, so the router's gradient is cp times too large. Megatron-LM #5047 (and #3768): an MoE aux loss or
    z-loss scaled for the wrong group, its gradient depending on the TP/CP size, fixed by scaling with the tp x cp
    group's size (there the term came out too small; here, scaled for the larger group, it comes out too large).
    Right at cp=1, where the two groups are one."""

    name = "aux_scaled_for_token_group"

    def auxiliary_scale(self, window: Sequence[Microbatch], mesh: Any, tokens: int) -> float:
        return token_group_size(mesh) / data_microbatches(window, mesh)


@control(Target("parity", "uneven", objective="sequence_mean", mesh=MESH), "per_shard_sequence_mean")
class PerShardSequenceMean(SequenceMean):
    """The sequence mean written without cp in mind, run on a dp x cp mesh: each cp rank divides its chunk of a
    sequence by the chunk's own count of that sequence's tokens (a per-shard mean: the chunks of one sequence weigh
    alike whatever their counts), and counts the sequences over every rank, once per chunk holding one of their
    tokens. Right on ``dp=W``; ``harness.recipes.mesh_objectives:mesh_sequence_mean`` is its right twin (each row's
    count all-reduced over the cp group, the sequences counted over the data-parallel group)."""

    name = "per_shard_sequence_mean"


ULYSSES = "harness.ulysses:ulysses"
"""The built-in model with Ulysses' attention (heads over cp, two all-to-alls): the sequence-parallel model the two
controls below run on."""


@control(Target("parity", "uneven", mesh=MESH, model=ULYSSES), "global_scale")
class LossTimesDataParallelUnderSp:
    """Ulysses sequence parallelism with the loss scaled by the data-parallel size where the gradients are averaged
    over dp x sp: each rank's loss sum times ``dp / N`` (``N`` the window's count, rightly all-reduced over dp x sp),
    where ``dp * sp / N`` belongs. Every gradient is ``1/sp`` of the reference's (VeOmni PR #338: ``loss * dp_size``
    where its fsdp group, dp x sp, averages; its own check, 8 ranks at sp=8, logged a loss 8 times too small). Right
    on a mesh without sp (cp here)."""

    name = "loss_times_dp_under_sp"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        total = require_tokens(_count_over(window, token_group(mesh)))
        size = int(mesh["dp"].size())
        accumulate(model, window, lambda s: global_token_loss(s, total, size))
        return None


def shifted_again(mb: Microbatch) -> Microbatch:
    """``mb`` with its labels moved one more column to the left within what this rank holds: each column's target
    becomes the next column's (the chunk's first target dropped, its last column unsupervised). On a cp rank of a
    model that shards the sequence the columns are its chunk, already shifted before sharding."""
    labels = torch.full_like(mb.labels, IGNORE_INDEX)
    labels[:, :-1] = mb.labels[:, 1:]
    weights = None
    if mb.weights is not None:
        weights = torch.zeros_like(mb.weights)
        weights[:, :-1] = mb.weights[:, 1:]
    return dataclasses.replace(mb, labels=labels, weights=weights)


@control(Target("parity", "uneven", mesh=MESH, model=ULYSSES), "labels_shifted_per_chunk")
class LabelsShiftedAgainPerChunk:
    """Ulysses sequence parallelism whose labels were shifted for next-token prediction and sharded, and are shifted
    again on each rank, as a loss written for unshifted labels does (ms-swift PR #10185): every sp rank drops its
    chunk's first target and trains each position to predict the target of the position after it, the token two
    ahead. The count is the shifted labels' own, over dp x sp, and the factor right. Right nowhere: on a mesh without
    sp it shifts every row instead (a double shift)."""

    name = "labels_shifted_again_per_chunk"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        shifted = [shifted_again(mb) for mb in window]
        total = require_tokens(_count_over(shifted, token_group(mesh)))
        size = token_group_size(mesh)
        accumulate(model, shifted, lambda s: global_token_loss(s, total, size))
        return None
