"""Negative controls, objectives family. A recipe right for one declared objective judged under another, and the
mistakes of each objective's own normalization (:mod:`harness.core.objectives`): a weighted mean divided by the
all-reduced count instead of the weight sum, a fixed normalizer taken from the local batch's padded length, and an
auxiliary term normalized in another unit than its own.

Each class declares where the battery rejects it, under which objective, and what the diagnosis reads in its gradient
(``@control``, :mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from harness.core.microbatch import IGNORE_INDEX
from harness.recipes.catalog import Target, control
from harness.recipes.correct import GlobalTokenMean, _world_size
from harness.recipes.helpers import sync_context
from harness.recipes.objectives import (
    BATCH_SIZE,
    FixedNormalizer,
    SequenceMean,
    TokenMeanWithLoadBalance,
    WeightedTokenMean,
    forward,
    window_tokens,
)


@control(Target("parity", "uneven", objective="sequence_mean"), "other_objective")
class TokenMeanUnderSequenceMean(GlobalTokenMean):
    """The correct token-mean recipe judged under ``--objective=sequence_mean``: right for its own objective, a long
    sequence's tokens each weigh what a short one's do, so long sequences weigh more than the sequence mean gives
    them. The diagnosis names the objective it computes: the token mean."""

    name = "token_mean_under_sequence_mean"


@control(Target("parity", "uneven", objective="weighted_token_mean"), "wrong_normalizer")
class WeightedByCount(WeightedTokenMean):
    """``sum(w_t * l_t)`` over the all-reduced supervised *count* instead of the all-reduced weight sum: the weights
    enter the numerator and are forgotten in the denominator (a class-weighted loss normalized like a token mean)."""

    name = "weighted_by_count"

    def divisor(self, window: Sequence[Any]) -> float:
        return float(window_tokens(window))


@control(Target("parity", "uneven", objective="fixed_normalizer"), "per_rank_normalizer")
class LocalMaxLength(FixedNormalizer):
    """Declares batch size x maximum completion length, and divides by batch size x the *local* window's padded
    length (``completion_mask.size(1)``) instead: right only where every rank's batch is padded to the maximum
    length, so it fails as soon as lengths differ across ranks; each rank then weighs its own factor."""

    name = "local_max_length"

    def divisor(self, window: Sequence[Any]) -> float:
        return float(BATCH_SIZE * max(int(mb.labels.shape[1]) for mb in window))


@control(Target("parity", "uneven"), "auxiliary_token_normalized")
class AuxiliaryTokenNormalized(TokenMeanWithLoadBalance):
    """The load-balancing term added to the loss sum before the main loss's ``W / N``: a per-microbatch term
    scaled by the token count, so its weight depends on how many tokens the window holds."""

    name = "auxiliary_token_normalized"

    def auxiliary(self, model: nn.Module, mb: Any, raw: torch.Tensor, k: int, tokens: int) -> torch.Tensor | None:
        return self.auxiliary_loss(model, mb, raw) * (_world_size() / tokens)


@control(Target("parity", "uneven"), "auxiliary_divided_twice")
class AuxiliaryDividedTwice(TokenMeanWithLoadBalance):
    """The load-balancing term divided by the microbatch count k in the loop, and again where it is added (a term
    already averaged over microbatches, divided by the accumulation steps once more)."""

    name = "auxiliary_divided_twice"

    def auxiliary(self, model: nn.Module, mb: Any, raw: torch.Tensor, k: int, tokens: int) -> torch.Tensor | None:
        return self.auxiliary_loss(model, mb, raw) / k / k


@control(Target("parity", "uneven"), "auxiliary_summed_over_ranks")
class AuxiliarySummedOverRanks(TokenMeanWithLoadBalance):
    """The load-balancing term multiplied by W like the main loss: the main loss's W cancels DDP's average of a
    globally normalized sum, a per-microbatch mean has no such division to cancel, so the term is summed over the
    ranks instead of averaged."""

    name = "auxiliary_summed_over_ranks"

    def auxiliary(self, model: nn.Module, mb: Any, raw: torch.Tensor, k: int, tokens: int) -> torch.Tensor | None:
        return self.auxiliary_loss(model, mb, raw) * _world_size() / k


def _supervised_rows(window: Sequence[Any]) -> int:
    labels = [mb["labels"][:, 1:] if isinstance(mb, dict) else mb.labels for mb in window]
    return sum(int(((lab != IGNORE_INDEX).sum(dim=1) > 0).sum()) for lab in labels)


@control(Target("parity", "uneven", objective="sequence_mean"), "mean_of_local_means")
class LocalSequenceCount(SequenceMean):
    """The sequence mean over this rank's own supervised rows, and DDP's average over the ranks: a mean of local
    sequence means. Exact wherever every rank holds as many supervised rows, so the battery's scenarios give ranks
    different numbers of rows (``harness.battery.scenarios.row_counts``)."""

    name = "local_sequence_count"

    def divisor(self, window: Sequence[Any]) -> float:
        return float(_world_size() * _supervised_rows(window))


@control(Target("parity", "uneven", objective="sequence_mean"), "per_microbatch_mean")
class PerMicrobatchSequenceMean(SequenceMean):
    """Each microbatch's own sequence mean (``loss.mean()`` over its per-sequence losses) divided by the microbatch
    count k, as a loop written for per-sample losses does: every microbatch weighs 1/k where it should weigh its share
    of the rows. Exact only where every microbatch holds as many supervised rows (the per-microbatch sample-count
    ratio is then 1/k), so the battery's microbatches hold different numbers of rows."""

    name = "per_microbatch_sequence_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Any]) -> float | None:
        window_tokens(window)  # every rank refuses a window without a supervised token, together
        for i, mb in enumerate(window):
            with sync_context(model, i, len(window)):
                _, ce, mask, _ = forward(model, mb)
                rows = int((mask.sum(dim=1) > 0).sum())
                (self.term(ce, mask, None) / max(rows, 1) / len(window)).backward()
        return None
