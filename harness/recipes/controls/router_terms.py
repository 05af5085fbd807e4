"""Negative controls, router-terms family (``--model harness.moe:moe``): the load-balancing term of a
mixture-of-experts router normalized by another fact of the window than its unit's, each the public record's
mistake at the factor its issue states. The main loss is right in every one; the diagnosis fits the term's columns
beside the main loss's blocks and names the fact its weight is off by (:mod:`harness.diagnosis.auxiliary_units`).
The correct recipes are :mod:`harness.recipes.moe_terms`'s.

Each class declares where the battery rejects it and what the diagnosis reads (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from harness.moe import router_outputs
from harness.recipes.catalog import Target, control
from harness.recipes.helpers import token_group_size
from harness.recipes.moe_terms import (
    GlobalRouterBalance,
    RouterBalancePerMicrobatch,
    SequenceRouterBalance,
    TokenRouterBalance,
    row_balance,
)

MOE = "harness.moe:moe"


@control(Target("parity", "long", model=MOE), "auxiliary_not_divided_by_k")
class RouterBalanceEveryMicrobatch(RouterBalancePerMicrobatch):
    """The load-balancing term added whole to every microbatch's loss, never divided by the accumulation steps,
    while the language-model loss is normalized for the whole window: NeMo Automodel PR #3359 ("each model-provided
    MoE auxiliary loss entered every microbatch backward pass without the matching accumulation normalization"). The
    term weighs k times its per-microbatch mean; judged on ``long`` (k=5), where k is no other fact of the window."""

    name = "router_balance_every_microbatch"

    def scale(self, window: Sequence[Any], masks: Sequence[torch.Tensor], mesh: Any, tokens: int,
              context: Any) -> float:
        return super().scale(window, masks, mesh, tokens, context) * len(window)


@control(Target("parity", "uneven", model=MOE), "auxiliary_divided_by_dp")
class GlobalRouterBalanceOverDataRanks(GlobalRouterBalance):
    """A "global" load-balancing term whose fractions are the whole window's, each rank backpropagating its own
    tokens' probabilities against them over the global N without the data group's size: the gradients' average over
    the data ranks then averages the shares instead of summing them. Megatron-LM #3672 (PR #3769): ``global_aux_loss``
    divides by the global token count while its probabilities are local, so its gradient is 1/dp of ``aux_loss``'s at
    the same coefficient."""

    name = "global_router_balance_over_data_ranks"

    def scale(self, window: Sequence[Any], masks: Sequence[torch.Tensor], mesh: Any, tokens: int,
              context: Any) -> float:
        return 1.0 / tokens


@control(Target("parity", "uneven", model=MOE), "auxiliary_divided_by_micro_batch_size")
class SequenceRouterBalanceOverLength(SequenceRouterBalance):
    """The sequence-level load-balancing term averaged over each microbatch's B rows (``.mean()`` over the batch
    dimension) where the sum over its sequences belongs: Megatron-LM PR #5798, where ``_apply_seq_aux_loss`` passed
    the sequence length as the microbatch's token count instead of length x micro-batch size, leaving a spurious 1/MBS
    on the term's gradient. Each sequence weighs 1/(B x S); the battery's microbatches hold different B."""

    name = "sequence_router_balance_over_length"

    def value(self, model: torch.nn.Module, mask: torch.Tensor, context: Any) -> torch.Tensor:
        per_row = row_balance(router_outputs(model), mask)
        return self.coefficient * per_row.sum() / mask.shape[0]


@control(Target("parity", "uneven", model=MOE), "auxiliary_not_divided_by_tokens")
class RouterTokenBalanceUnnormalized(TokenRouterBalance):
    """A per-token router term (each microbatch's term times its tokens, as Megatron-LM's per-token loss mode
    pre-multiplies it) scaled like the main loss by the token group's size and never divided by the token total:
    verl #6609 (PR #6836), where the loss function returned no token count under ``calculate_per_token_loss`` and the
    MoE aux loss's gradient came out about ``num_tokens`` times too large. The term weighs N times its unit's."""

    name = "router_token_balance_unnormalized"

    def scale(self, window: Sequence[Any], masks: Sequence[torch.Tensor], mesh: Any, tokens: int,
              context: Any) -> float:
        return float(token_group_size(mesh))


MOE_TP = "harness.moe_tp:moe"
"""The built-in mixture-of-experts model under tensor parallelism with sequence parallelism: each tp rank's router
routes its own shard of the sequence (:mod:`harness.moe_tp`)."""


@control(Target("parity", "uneven", strategy="fsdp2", mesh="dp=2,tp=2", model=MOE_TP), "auxiliary_divided_by_tp")
class RouterTokenBalanceOverLocalTokens(TokenRouterBalance):
    """A per-token router term pre-multiplied by the router's *local* token count under sequence parallelism:
    Megatron-LM PR #5047 (#1652), where ``--calculate-per-token-loss`` scaled ``aux_loss`` and ``z_loss`` by
    ``num_local_tokens``, the tokens of this tp rank's sequence shard (the microbatch's over tp when every shard holds
    as many), while every gradient is divided by the whole window's token total: the term weighs 1/tp of its unit's,
    a router strength that changes with the tp size. The term is the whole microbatch's on every tp rank (the
    routing gathered over tp), so only the count is the shard's; the fix multiplies the scale by tp (the size of the
    group the tokens are sharded over)."""

    name = "router_token_balance_over_local_tokens"

    def scale(self, window: Sequence[Any], masks: Sequence[torch.Tensor], mesh: Any, tokens: int,
              context: Any) -> float:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        tp = int(mesh["tp"].size()) if "tp" in names else 1
        return super().scale(window, masks, mesh, tokens, context) / tp


__all__ = ["MOE", "MOE_TP", "GlobalRouterBalanceOverDataRanks", "RouterBalanceEveryMicrobatch",
           "RouterTokenBalanceOverLocalTokens", "RouterTokenBalanceUnnormalized", "SequenceRouterBalanceOverLength"]
