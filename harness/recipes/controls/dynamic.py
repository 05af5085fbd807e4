"""Negative controls, dynamic family: how RL trainers normalize a loss over token-budget micro-batches and over a
constant. verl's ``use_dynamic_bsz`` re-splits a rank's window by a token budget (:mod:`harness.recipes.dynamic`),
so a rank's micro-batch count is its own; Dr. GRPO divides the loss sum by a constant, which DDP's average over the
ranks then divides once more.

Each class declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from harness.core.microbatch import Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.correct import forward_loss_sum, global_sum, window_count
from harness.recipes.dynamic import TOKEN_BUDGET, dynamic_microbatches
from harness.recipes.helpers import sync_context
from harness.recipes.objectives import FixedNormalizer, forward, window_tokens


@control(Target("parity", "token_budget"), "dynamic_microbatch_mean")
class DynamicMicrobatchMean:
    """Each token-budget micro-batch's own token mean divided by the number of this rank's micro-batches, as verl's
    Megatron actor did under ``use_dynamic_bsz`` before it weighed each micro-batch by its share (verl #3294, reopened
    as #4021: "this may cause the loss weights work wrong especially for dynamic batching when the sample length varies
    a lot"). A token of micro-batch d on rank r weighs ``1/(W * K_r * n_d)``: right only where every micro-batch of
    every rank holds as many tokens, and ranks re-split by a budget run different numbers of micro-batches."""

    name = "dynamic_microbatch_mean"
    budget = TOKEN_BUDGET

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        window_count(window)  # every rank refuses a window without a supervised token, together
        parts = dynamic_microbatches(model, window, self.budget)
        for i, mb in enumerate(parts):
            with sync_context(model, i, len(parts)):
                s = forward_loss_sum(model, mb)
                (s / max(mb.supervised, 1) / len(parts)).backward()
        return None


@control(Target("parity", "uneven", objective="fixed_normalizer"), "constant_averaged_over_ranks")
class FixedNormalizerWithoutDp(FixedNormalizer):
    """Dr. GRPO's constant normalizer (``loss_agg_mode="seq-mean-token-sum-norm"``) without the data-parallel factor:
    each rank's loss sum divided by the constant C, and DDP's average over the W ranks divides it by W once more, so
    every token weighs ``1/(W C)``, 1/W of the declared objective. verl added ``* dp_size`` to the loss (#5366: FSDP
    averages the gradients over the ranks; #3741 had questioned this loss's scale): without it the constant objective
    is 1/dp of itself."""

    name = "fixed_normalizer_without_dp"

    def backward_window(self, model: nn.Module, window: Sequence[Any]) -> float | None:
        window_tokens(window)  # every rank refuses a window without a supervised token, together
        c, local = self.divisor(window), 0.0
        for i, mb in enumerate(window):
            with sync_context(model, i, len(window)):
                _, ce, mask, weights = forward(model, mb)
                term = self.term(ce, mask, weights if self.reads_weights else None)
                (term / c).backward()  # the constant alone: no W to undo the ranks' average
            local += float(term.detach())
        return global_sum(local) / c  # the logged loss is right: the mistake is in the gradient alone


@control(Target("parity", "token_budget"), "dynamic_microbatch_rows_share")
class DynamicMicrobatchRowsShare(DynamicMicrobatchMean):
    """Each token-budget micro-batch's own token mean weighted by its share of the rank's rows, as verl's FSDP actor
    scales it under ``use_dynamic_bsz`` (``loss = policy_loss * (response_mask.shape[0] / ppo_mini_batch_size)``,
    with ``loss_agg_mode="token-mean"``): a token of micro-batch d on rank r weighs ``B_d / (W * B_r * n_d)``, right
    only where every row holds as many tokens, so a micro-batch of short rows weighs as much as one of long rows."""

    name = "dynamic_microbatch_rows_share"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        window_count(window)  # every rank refuses a window without a supervised token, together
        parts = dynamic_microbatches(model, window, self.budget)
        rows = sum(int(mb.inputs.shape[0]) for mb in parts)
        for i, mb in enumerate(parts):
            with sync_context(model, i, len(parts)):
                s = forward_loss_sum(model, mb)
                (s / max(mb.supervised, 1) * (mb.inputs.shape[0] / rows)).backward()
        return None
