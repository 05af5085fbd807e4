"""Correct recipes for the router auxiliary terms of the built-in mixture-of-experts model (``--model
harness.moe:moe``): the token mean plus the Switch load-balancing term in each of its units, on ``dp=W`` and on a
mesh with cp (docs/objectives.md, "Router auxiliary terms").

Every term here counts the window's *supervised* tokens (``labels != IGNORE_INDEX``), so that padding and prompts,
whose share depends on how rows were batched, move nothing. Under cp a rank's labels hold its chunk only while its
router sees the whole rows (each cp rank runs its coordinate's whole forward), so the recipe all-reduces the mask over
the cp group first: every cp rank of a data coordinate then holds the same value of the term, its group is the
data-parallel one, and each rank scales it by dp's size (the gradients' average over dp x cp keeps cp copies of it,
once over dp). Without cp that factor is W, the world.

- ``router_balance_per_microbatch`` (unit ``microbatch``): the term of each microbatch, averaged over every
  microbatch of every data rank: ``dp / M`` (``1/k``) on each rank.
- ``sequence_router_balance`` (unit ``sequence``, Megatron-LM's ``seq_aux_loss``): the term of each sequence (row)
  over its own tokens, averaged over the window's S sequences with a supervised token: each rank adds ``dp * (sum
  over its microbatch's sequences) / S``, S all-reduced over the data group.
- ``global_router_balance`` (unit ``global``, Megatron-LM's ``global_aux_loss``): the assignment fractions and mean
  probabilities of the whole window's tokens. A first pass without gradients counts each microbatch's assignments;
  their all-reduce over the data group gives ``f(G)``; each microbatch then adds ``dp * E * sum_e f_e(G) * S_e(m) /
  N`` (:mod:`harness.core.router_terms`): summed over the data ranks by the gradients' average, the whole term.
- ``token_router_balance`` (unit ``token``): each microbatch's term weighted by its supervised tokens, ``n_m *
  LB_m``, over the window's N (Megatron-LM's aux loss under ``calculate_per_token_loss``): ``dp * n_m * LB_m / N``.

Run one::

    python -m harness battery --model harness.moe:moe --recipe harness.recipes.moe_terms:global_router_balance
    python -m harness battery --model harness.moe:moe --mesh dp=2,cp=2 \\
        --recipe harness.recipes.moe_terms:sequence_router_balance
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.core import router_terms as rt
from harness.core.loss import count_device, global_count
from harness.core.microbatch import IGNORE_INDEX
from harness.moe import RouterOutput, load_balancing_loss, router_outputs
from harness.moe_plan import unwrapped
from harness.recipes.correct import global_sum
from harness.recipes.helpers import (
    data_group,
    data_group_size,
    require_tokens,
    sync_context,
    token_group,
    token_group_size,
)
from harness.recipes.objectives import Batch, _labels, data_microbatches, forward

ROUTER_BALANCE = 0.1
"""The load-balancing term's coefficient (Switch Transformer's 1e-2 scaled up so that its gradient stands well above
the tolerances)."""


def counted(batch: Batch) -> torch.Tensor:
    """The positions of the batch's inputs whose token counts (bool ``[B, T]``): those whose target is supervised. In
    the ``hf`` dict the target of position t is ``labels[:, t + 1]``; the last position has none."""
    if isinstance(batch, Mapping):
        labels = batch["labels"]
        mask = torch.zeros_like(labels, dtype=torch.bool)
        mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
        return mask
    return batch.labels != IGNORE_INDEX


def whole_rows(mask: torch.Tensor, mesh: Any) -> torch.Tensor:
    """``mask`` over the whole rows: under cp each rank holds its chunk's supervised positions, so the masks are
    summed over the cp group (every position is supervised on one cp rank at most); without cp, ``mask``."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "cp" not in names or mesh["cp"].size() == 1:
        return mask
    total = mask.to(device=count_device(), dtype=torch.int64)
    dist.all_reduce(total, group=mesh["cp"].get_group())
    return (total > 0).to(mask.device)


def row_balance(outputs: Sequence[RouterOutput], mask: torch.Tensor) -> torch.Tensor:
    """Each row's Switch term over its own counted tokens (``[B]``, the mean over the MoE layers of ``E * sum_e f_e
    * P_e``, as :func:`harness.moe.load_balancing_loss` computes it over one row): 0, still connected to the router,
    for a row without a counted token."""
    rows, length = mask.shape
    per_layer = []
    for out in outputs:
        e, k = out.experts, out.top_k
        probs = out.probs.view(rows, length, e)
        m = mask.to(probs.device).unsqueeze(-1).to(probs.dtype)
        n = m.sum(dim=1).clamp(min=1)
        mean_probs = (probs * m).sum(dim=1) / n
        chosen = F.one_hot(out.chosen, e).view(rows, length, k, e).sum(dim=2).to(probs.dtype)
        fractions = (chosen * m).sum(dim=1) / (k * n)
        per_layer.append(e * (fractions * mean_probs).sum(dim=-1))
    return torch.stack(per_layer).mean(dim=0)


def supervised_rows(mask: torch.Tensor) -> int:
    return int((mask.sum(dim=1) > 0).sum())


class RouterTermRecipe:
    """The token mean over the token group (dp x cp, or every rank) plus a router term of the unit
    :attr:`auxiliary_unit`, scaled by :meth:`scale`. A unit says what a microbatch's value is
    (:meth:`auxiliary_loss`, the declaration the reference calls) and what a rank multiplies it by."""

    name = "router_term"
    auxiliary_unit = "microbatch"
    coefficient = ROUTER_BALANCE

    def auxiliary_loss(self, model: nn.Module, batch: Batch, logits: torch.Tensor) -> Any:
        """The microbatch's value of the term, from the router outputs of the forward that gave ``logits``."""
        raise NotImplementedError

    def prepare(self, model: nn.Module, window: Sequence[Batch], masks: Sequence[torch.Tensor], mesh: Any) -> Any:
        """What the unit needs from the whole window before the first backward (None: nothing)."""
        return None

    def value(self, model: nn.Module, mask: torch.Tensor, context: Any) -> torch.Tensor:
        """The microbatch's value over its whole rows' ``mask``, from the last forward's router outputs."""
        raise NotImplementedError

    def scale(self, window: Sequence[Batch], masks: Sequence[torch.Tensor], mesh: Any, tokens: int,
              context: Any) -> float:
        """What a rank multiplies each microbatch's value by."""
        raise NotImplementedError

    def backward_window(self, model: nn.Module, window: Sequence[Batch], mesh: Any = None) -> float | None:
        group, size = token_group(mesh), token_group_size(mesh)
        tokens = require_tokens(global_count(sum(int((_labels(mb) != IGNORE_INDEX).sum()) for mb in window),
                                             group=group))
        masks = [whole_rows(counted(mb), mesh) for mb in window]
        context = self.prepare(model, window, masks, mesh)
        scale = self.scale(window, masks, mesh, tokens, context)
        local = 0.0
        for i, (mb, mask) in enumerate(zip(window, masks)):
            with sync_context(model, i, len(window)):
                _, ce, _, _ = forward(model, mb)
                aux = self.value(model, mask, context) * scale
                (ce.sum() * (size / tokens) + aux).backward()
            # Each rank's share of the objective's value: the gradients' average over the token group gives the same.
            local += float(ce.detach().sum()) / tokens + float(aux.detach()) / size
        return global_sum(local, group)


class RouterBalancePerMicrobatch(RouterTermRecipe):
    """Unit ``microbatch``: each microbatch's term over its supervised tokens, averaged over every microbatch of
    the data group (``dp / M`` on each rank, ``1/k``)."""

    name = "router_balance_per_microbatch"
    auxiliary_unit = "microbatch"

    def auxiliary_loss(self, model: nn.Module, batch: Batch, logits: torch.Tensor) -> Any:
        return self.coefficient * load_balancing_loss(router_outputs(model), counted(batch))

    def value(self, model: nn.Module, mask: torch.Tensor, context: Any) -> torch.Tensor:
        return self.coefficient * load_balancing_loss(router_outputs(model), mask)

    def scale(self, window: Sequence[Batch], masks: Sequence[torch.Tensor], mesh: Any, tokens: int,
              context: Any) -> float:
        return data_group_size(mesh) / data_microbatches(window, mesh)


class SequenceRouterBalance(RouterTermRecipe):
    """Unit ``sequence``: each sequence's term over its own supervised tokens, summed over the microbatch's
    sequences, over S (the data group's sequences with a supervised token), times dp."""

    name = "sequence_router_balance"
    auxiliary_unit = "sequence"

    def auxiliary_loss(self, model: nn.Module, batch: Batch, logits: torch.Tensor) -> Any:
        return self.coefficient * row_balance(router_outputs(model), counted(batch)).sum()

    def prepare(self, model: nn.Module, window: Sequence[Batch], masks: Sequence[torch.Tensor], mesh: Any) -> Any:
        return global_count(sum(supervised_rows(m) for m in masks), group=data_group(mesh))

    def value(self, model: nn.Module, mask: torch.Tensor, context: Any) -> torch.Tensor:
        return self.coefficient * row_balance(router_outputs(model), mask).sum()

    def scale(self, window: Sequence[Batch], masks: Sequence[torch.Tensor], mesh: Any, tokens: int,
              context: Any) -> float:
        return data_group_size(mesh) / context


def _statistics(model: nn.Module, mask: torch.Tensor, coefficient: float) -> list[rt.RouterStatistics]:
    return [rt.statistics(out.probs, out.chosen, mask, coefficient) for out in router_outputs(model)]


class GlobalRouterBalance(RouterTermRecipe):
    """Unit ``global``: the term of the whole window's statistics. A first pass without gradients counts each
    microbatch's assignments (through the unwrapped model: no synchronization is prepared); the counts all-reduced
    over the data group give ``f(G)``; each microbatch adds its numerator (its tokens' probabilities against
    ``f(G)``) times ``dp / N``."""

    name = "global_router_balance"
    auxiliary_unit = "global"

    def auxiliary_loss(self, model: nn.Module, batch: Batch, logits: torch.Tensor) -> Any:
        return _statistics(model, counted(batch), self.coefficient)

    def prepare(self, model: nn.Module, window: Sequence[Batch], masks: Sequence[torch.Tensor], mesh: Any) -> Any:
        inner = unwrapped(model)
        with torch.no_grad():
            seen = []
            for mb, mask in zip(window, masks):
                forward(inner, mb)
                seen.append(_statistics(inner, mask, self.coefficient))
        totals = torch.stack([torch.stack([s.assignments.to(torch.float64) for s in layers]) for layers in seen])
        counts = totals.sum(dim=0).to(count_device())  # [layers, E]
        if dist.is_initialized():
            dist.all_reduce(counts, group=data_group(mesh))
        return [c.cpu() / c.sum() if float(c.sum()) > 0 else c.cpu() for c in counts]

    def value(self, model: nn.Module, mask: torch.Tensor, context: Any) -> torch.Tensor:
        return rt.global_numerator(_statistics(model, mask, self.coefficient), context)

    def scale(self, window: Sequence[Batch], masks: Sequence[torch.Tensor], mesh: Any, tokens: int,
              context: Any) -> float:
        return data_group_size(mesh) / tokens


class TokenRouterBalance(RouterTermRecipe):
    """Unit ``token``: each microbatch's term weighted by its supervised tokens, ``n_m * LB_m``, over the window's
    N, times dp."""

    name = "token_router_balance"
    auxiliary_unit = "token"

    def auxiliary_loss(self, model: nn.Module, batch: Batch, logits: torch.Tensor) -> Any:
        mask = counted(batch)
        return self.coefficient * int(mask.sum()) * load_balancing_loss(router_outputs(model), mask)

    def value(self, model: nn.Module, mask: torch.Tensor, context: Any) -> torch.Tensor:
        return self.coefficient * int(mask.sum()) * load_balancing_loss(router_outputs(model), mask)

    def scale(self, window: Sequence[Batch], masks: Sequence[torch.Tensor], mesh: Any, tokens: int,
              context: Any) -> float:
        return data_group_size(mesh) / tokens


router_balance_per_microbatch = RouterBalancePerMicrobatch()
sequence_router_balance = SequenceRouterBalance()
global_router_balance = GlobalRouterBalance()
token_router_balance = TokenRouterBalance()

ROUTER_RECIPES = {
    "harness.recipes.moe_terms:router_balance_per_microbatch": "microbatch",
    "harness.recipes.moe_terms:sequence_router_balance": "sequence",
    "harness.recipes.moe_terms:global_router_balance": "global",
    "harness.recipes.moe_terms:token_router_balance": "token",
}
"""Every correct router-term recipe and its unit (each judged under ``--objective token_mean`` with ``--model
harness.moe:moe``)."""

__all__ = [
    "ROUTER_BALANCE",
    "ROUTER_RECIPES",
    "GlobalRouterBalance",
    "RouterBalancePerMicrobatch",
    "RouterTermRecipe",
    "SequenceRouterBalance",
    "TokenRouterBalance",
    "counted",
    "global_router_balance",
    "router_balance_per_microbatch",
    "row_balance",
    "sequence_router_balance",
    "supervised_rows",
    "token_router_balance",
    "whole_rows",
]
