"""Correct recipes for every declared objective (``--objective``), a policy-gradient loss in each normalization, and
auxiliary terms in their own units: recipes to copy, each checked under its own objective by the battery.

The rule under every objective (:mod:`harness.core.objectives`): all-reduce the quantity the objective divides by
(the supervised count, the sequence count, the weight sum) before any backward, then backpropagate each microbatch's
term of the numerator times ``W / Z``: DDP's average over the W ranks cancels the W. A constant normalizer needs no
all-reduce of its own, but the window's supervised count still decides whether there is anything to train on.

Run one through the battery under its objective, e.g.::

    pytest -m recipe --objective=sequence_mean --recipe=harness.recipes.objectives:sequence_mean
    python -m harness battery --objective fixed_normalizer --recipe harness.recipes.objectives:pg_fixed_normalizer

The policy-gradient recipes are the normalizations preference and RL fine-tuning choose between (GRPO and its
variants): the per-token loss is ``-A_t * log p(y_t)`` (the on-policy REINFORCE loss with per-token advantages ``A_t``,
which the harness draws into ``Microbatch.weights`` when a recipe declares ``token_weights = "advantages"``), and

- ``pg_sequence_mean``: a mean per sequence, then over the sequences of the global batch (GRPO's original "grpo");
- ``pg_token_mean``: a token mean over the whole accumulated batch across devices (DAPO's token-level loss);
- ``pg_fixed_normalizer``: the sum over tokens divided by a constant, batch size x maximum completion length
  (Dr. GRPO), which every rank and microbatch shares without any all-reduce.

Each is right for its own objective and wrong for the others (``tests/distributed/test_objectives.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.core.formats import hf_forward, logits_of
from harness.core.microbatch import IGNORE_INDEX, PAD
from harness.recipes.correct import _world_size, global_sum
from harness.recipes.helpers import (
    data_group,
    data_group_size,
    global_count,
    require_tokens,
    sync_context,
    token_group,
    token_group_size,
)

Batch = Any
"""One microbatch in any batch format (a ``Microbatch``, or the ``hf`` or ``packed`` dict)."""

MAX_COMPLETION_LENGTH = 128
"""The fixed-normalizer recipes' maximum completion length: the battery's longest sequence."""

BATCH_SIZE = 8
"""The fixed-normalizer recipes' batch size: a constant of their configuration, as in Dr. GRPO's."""


def forward(model: nn.Module, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(raw logits, per-token cross-entropy [B, T], supervised mask [B, T], the batch's weights or None)``, aligned
    in either batch format: the hf dict's shift (``logits[:, :-1]`` against ``labels[:, 1:]``) is done here."""
    if isinstance(mb, Mapping):
        raw = hf_forward(model, mb)  # hf, or packed (position_ids, no attention_mask)
        logits, labels = raw[:, :-1], mb["labels"][:, 1:]
        weights = mb["weights"][:, 1:] if "weights" in mb else None
    else:
        raw = logits_of(model(mb.inputs))
        logits, labels, weights = raw, mb.labels, mb.weights
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return raw, ce.view(labels.shape), labels != IGNORE_INDEX, weights


def _labels(mb: Batch) -> torch.Tensor:
    return mb["labels"][:, 1:] if isinstance(mb, Mapping) else mb.labels


def _weights(mb: Batch) -> torch.Tensor | None:
    if isinstance(mb, Mapping):
        return mb["weights"][:, 1:] if "weights" in mb else None
    return mb.weights


def sequence_ids(mb: Batch) -> torch.Tensor | None:
    """Each aligned position's sequence, numbered within the microbatch (``[B, T]``, aligned like :func:`forward`'s
    losses), for a ``packed`` batch, whose rows hold several sequences: its ``seq_idx`` (else the restarts of its
    ``position_ids``), shifted like the labels. None for a batch whose rows are its sequences (harness, ``hf``)."""
    if not isinstance(mb, Mapping) or "position_ids" not in mb or "attention_mask" in mb:
        return None
    if "seq_idx" in mb:
        ids = mb["seq_idx"].to(torch.int64)
    else:  # a sequence starts wherever the positions restart at 0, counted over the rows in order
        ids = (mb["position_ids"] == 0).flatten().cumsum(0).view(mb["position_ids"].shape) - 1
    # The target at t + 1 is the label of the logit at t: the separator keeps every target inside its sequence.
    return ids[:, 1:]


def supervised_sequences(mb: Batch) -> int:
    """The sequences of one microbatch with a supervised token: its rows (harness, ``hf``), or in a ``packed`` batch
    its sequences by :func:`sequence_ids`, never its rows (one row holds several sequences)."""
    mask = _labels(mb) != IGNORE_INDEX
    ids = sequence_ids(mb)
    if ids is None:
        return int((mask.sum(dim=1) > 0).sum())
    return int(ids[mask].unique().numel())


def window_tokens(window: Sequence[Batch]) -> int:
    """The window's global supervised count, all-reduced on every rank; the contract's ValueError when it is 0."""
    return require_tokens(global_count(sum(int((_labels(mb) != IGNORE_INDEX).sum()) for mb in window)))


class _Recipe:
    """What the recipes below share: the loop (``no_sync()`` around all but the last microbatch, one backward per
    microbatch of ``term * W / Z``) and the logged loss (the objective's global value). A recipe says how a
    microbatch's per-token losses enter the numerator (:meth:`term`) and what it divides by (:meth:`divisor`)."""

    name = "objective_recipe"
    reads_weights = False
    """Whether the batch's ``weights`` enter its loss (the weighted mean; a loss with advantages). The others read
    the plain cross-entropy even where a batch carries weights."""

    def term(self, ce: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """One microbatch's term of the numerator (a sum over its supervised tokens)."""
        raise NotImplementedError

    def term_of(self, mb: Batch, ce: torch.Tensor, mask: torch.Tensor,
                weights: torch.Tensor | None) -> torch.Tensor:
        """:meth:`term` of microbatch ``mb`` (a recipe whose term depends on the batch's layout reads it here)."""
        return self.term(ce, mask, weights)

    def divisor(self, window: Sequence[Batch]) -> float:
        """``Z``, the same on every rank: an all-reduced quantity of the global window, or a constant."""
        raise NotImplementedError

    def auxiliary(self, model: nn.Module, mb: Batch, raw: torch.Tensor, k: int, tokens: int) -> torch.Tensor | None:
        """What this rank backpropagates for the microbatch's auxiliary term, in a window of ``k`` microbatches and
        ``tokens`` supervised tokens over every rank (None: no auxiliary term)."""
        return None

    def backward_window(self, model: nn.Module, window: Sequence[Batch]) -> float | None:
        tokens = window_tokens(window)  # every rank refuses a window without a supervised token, together
        z, world = self.divisor(window), _world_size()
        if z <= 0:
            msg = f"the window's normalizer is {z!r} (every supervised token weighs 0): nothing to train on"
            raise ValueError(msg)
        local = 0.0
        for i, mb in enumerate(window):
            with sync_context(model, i, len(window)):
                raw, ce, mask, weights = forward(model, mb)
                term = self.term_of(mb, ce, mask, weights if self.reads_weights else None)
                # W / Z: the objective's global normalizer, times W to cancel DDP's average over the ranks.
                loss = term * (world / z)
                aux = self.auxiliary(model, mb, raw, len(window), tokens)
                (loss if aux is None else loss + aux).backward()
            local += float(term.detach()) / z + (0.0 if aux is None else float(aux.detach()) / world)
        return global_sum(local)


def _factor(ce: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return ce if weights is None else weights.to(ce.dtype) * ce


class TokenMean(_Recipe):
    """The token mean, written as the objective recipes are: the loss sum over the all-reduced supervised count."""

    name = "token_mean"

    def term(self, ce: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        return _factor(ce, weights).sum()

    def divisor(self, window: Sequence[Batch]) -> float:
        return float(window_tokens(window))


class SequenceMean(_Recipe):
    """Each sequence's own token mean, summed, over the global count of sequences with a supervised token: every
    sequence weighs the same whatever its length. A ``packed`` batch's sequences are told apart by its ``seq_idx``
    (:func:`sequence_ids`), never by its rows: a row holds several sequences."""

    name = "sequence_mean"

    def term(self, ce: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None,
             ids: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of the sequences' means; ``ids`` (aligned like ``ce``) numbers each position's sequence where
        the rows are not the sequences (None: each row is one)."""
        values = _factor(ce, weights)
        if ids is None:
            counts = mask.sum(dim=1)
            # A row without a supervised token has no mean: it adds nothing here and counts for nothing in S.
            return (values.sum(dim=1) / counts.clamp(min=1)).sum()
        flat, keep = ids.flatten(), mask.flatten()
        size = int(flat.max()) + 1 if flat.numel() else 0
        sums = values.new_zeros(size).index_add(0, flat[keep], values.flatten()[keep])
        counts = torch.zeros(size, dtype=torch.int64, device=ce.device).index_add(
            0, flat[keep], torch.ones_like(flat[keep]))
        return (sums / counts.clamp(min=1).to(sums.dtype)).sum()

    def term_of(self, mb: Batch, ce: torch.Tensor, mask: torch.Tensor,
                weights: torch.Tensor | None) -> torch.Tensor:
        return self.term(ce, mask, weights, sequence_ids(mb))

    def divisor(self, window: Sequence[Batch]) -> float:
        return float(global_count(sum(supervised_sequences(mb) for mb in window)))


class WeightedTokenMean(_Recipe):
    """``sum(w_t * l_t) / sum(w_t)`` over the global window: the weight sum is all-reduced, like the count (class
    weights, importance weights, per-token masks with zeros)."""

    name = "weighted_token_mean"
    reads_weights = True

    def term(self, ce: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        return _factor(ce, weights).sum()

    def divisor(self, window: Sequence[Batch]) -> float:
        local = 0.0
        for mb in window:
            w = _weights(mb)
            mask = _labels(mb) != IGNORE_INDEX
            local += float(mask.sum()) if w is None else float((w.to(torch.float64) * mask).sum())
        return global_sum(local)


class FixedNormalizer(_Recipe):
    """The loss sum over a constant it declares (``normalizer``): batch size x maximum completion length."""

    name = "fixed_normalizer"
    normalizer = float(BATCH_SIZE * MAX_COMPLETION_LENGTH)
    """The constant the harness reads to build the reference (``--objective=fixed_normalizer``)."""

    def term(self, ce: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        return _factor(ce, weights).sum()

    def divisor(self, window: Sequence[Batch]) -> float:
        return self.normalizer


token_mean = TokenMean()
sequence_mean = SequenceMean()
weighted_token_mean = WeightedTokenMean()
fixed_normalizer = FixedNormalizer()


# -- the policy-gradient worked example -------------------------------------------------------------------------------


class PgTokenMean(TokenMean):
    """Policy gradient, token mean over the global accumulated batch: ``sum_t A_t * (-log p_t) / N``."""

    name = "pg_token_mean"
    token_weights = "advantages"
    reads_weights = True


class PgSequenceMean(SequenceMean):
    """Policy gradient, a mean per sequence then over the global batch's sequences (GRPO's original loss)."""

    name = "pg_sequence_mean"
    token_weights = "advantages"
    reads_weights = True


class PgFixedNormalizer(FixedNormalizer):
    """Policy gradient over a constant: ``sum_t A_t * (-log p_t) / (batch size x maximum completion length)``
    (Dr. GRPO)."""

    name = "pg_fixed_normalizer"
    token_weights = "advantages"
    reads_weights = True


pg_token_mean = PgTokenMean()
pg_sequence_mean = PgSequenceMean()
pg_fixed_normalizer = PgFixedNormalizer()


# -- auxiliary terms in their own units -------------------------------------------------------------------------------

LOAD_BALANCE = 0.5
"""The load-balancing term's coefficient."""

Z_LOSS = 1e-2
"""The z-loss coefficient."""


def load_balance(raw: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """A load-balancing-style term of one microbatch: ``V * sum_v p_v^2`` over the mean next-token distribution
    ``p`` of its real (non-padding) positions, times :data:`LOAD_BALANCE`; 1 x the coefficient when the predictions
    spread evenly, larger when they concentrate (a mixture of experts' router balance, with the vocabulary as its
    experts). One value per microbatch: its unit is the microbatch."""
    real = inputs != PAD
    p = raw.softmax(dim=-1)[real].mean(dim=0)
    return LOAD_BALANCE * p.shape[-1] * (p * p).sum()


def z_loss(raw: torch.Tensor, batch: Batch) -> torch.Tensor:
    """A z-loss of one microbatch: ``coef * logsumexp(logits)^2`` summed over its supervised positions (a sum over
    tokens: its unit is the token), :data:`Z_LOSS` the coefficient."""
    aligned = raw[:, :-1] if isinstance(batch, Mapping) else raw
    mask = _labels(batch) != IGNORE_INDEX
    return Z_LOSS * (aligned.logsumexp(dim=-1).pow(2) * mask).sum()


def _inputs(mb: Batch) -> torch.Tensor:
    return mb["input_ids"] if isinstance(mb, Mapping) else mb.inputs


class TokenMeanWithLoadBalance(TokenMean):
    """The token mean plus a load-balancing term, one value per microbatch, averaged over every microbatch of every
    rank: this rank adds ``aux / k`` (DDP's average over the ranks does the rest), whatever the main loss's
    normalization."""

    name = "token_mean_with_load_balance"
    auxiliary_unit = "microbatch"

    def auxiliary_loss(self, model: nn.Module, batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        """The term the reference adds (its unit's normalization is the harness's to apply)."""
        return load_balance(logits, _inputs(batch))

    def auxiliary(self, model: nn.Module, mb: Batch, raw: torch.Tensor, k: int, tokens: int) -> torch.Tensor | None:
        return self.auxiliary_loss(model, mb, raw) / k


class TokenMeanWithZLoss(TokenMean):
    """The token mean plus a z-loss, ``coef * logsumexp(logits)^2`` per supervised token, normalized like a token
    mean (its unit is the token): this rank adds ``W * (its z-loss sum) / N``."""

    name = "token_mean_with_z_loss"
    auxiliary_unit = "token"

    def auxiliary_loss(self, model: nn.Module, batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        return z_loss(logits, batch)

    def auxiliary(self, model: nn.Module, mb: Batch, raw: torch.Tensor, k: int, tokens: int) -> torch.Tensor | None:
        return self.auxiliary_loss(model, mb, raw) * (_world_size() / tokens)


token_mean_with_load_balance = TokenMeanWithLoadBalance()
token_mean_with_z_loss = TokenMeanWithZLoss()


# -- auxiliary terms on a device mesh ---------------------------------------------------------------------------------


class _MeshAuxiliary:
    """The token mean plus an auxiliary term on a device mesh (the ``mesh`` the harness passes: dp x cp, or dp=W).
    The main loss is :class:`harness.recipes.correct.MeshTokenMean`'s: the count all-reduced over the token group
    (dp x cp), each rank's loss sum times that group's size ``T`` over it. The auxiliary term is scaled by
    :meth:`auxiliary_scale`, the factor of its own unit's group: the gradients' average over the token group divides
    every rank's contribution by ``T``, and what a rank's factor must undo depends on which ranks hold distinct
    values of the term."""

    name = "mesh_auxiliary"

    def auxiliary_loss(self, model: nn.Module, batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def auxiliary_scale(self, window: Sequence[Batch], mesh: Any, tokens: int) -> float:
        """What this rank multiplies a microbatch's auxiliary value by, in a window of ``tokens`` supervised tokens
        over the token group."""
        raise NotImplementedError

    def backward_window(self, model: nn.Module, window: Sequence[Batch], mesh: Any = None) -> float | None:
        group, size = token_group(mesh), token_group_size(mesh)
        tokens = require_tokens(global_count(sum(int((_labels(mb) != IGNORE_INDEX).sum()) for mb in window),
                                             group=group))
        scale = self.auxiliary_scale(window, mesh, tokens)
        local = 0.0
        for i, mb in enumerate(window):
            with sync_context(model, i, len(window)):
                raw, ce, _, _ = forward(model, mb)
                aux = self.auxiliary_loss(model, mb, raw) * scale
                (ce.sum() * (size / tokens) + aux).backward()
            # Each rank's share of the objective's value: the gradients' average over T gives the same sum.
            local += float(ce.detach().sum()) / tokens + float(aux.detach()) / size
        return global_sum(local, group)


class MeshTokenMeanWithLoadBalance(_MeshAuxiliary):
    """The token mean plus the load-balancing term (:func:`load_balance`, unit the microbatch) on a mesh.

    The term has one value per microbatch, and its unit's group is the data-parallel one, not the token group: every
    cp rank of a data coordinate runs that coordinate's whole forward (a router's statistics are gathered over the
    sequence's chunks), so the cp ranks hold the *same* value of each microbatch's term, and the gradients' average
    over dp x cp counts it cp times over ``T = dp * cp``: once over dp. The factor is therefore the data-parallel size
    over the microbatch count of the data-parallel group, ``dp / M`` (``1/k`` with ``k`` microbatches per rank), and
    the term weighs ``1/M`` once per microbatch. Scaled by the token group's size instead (``T / M``, the main loss's
    factor), it weighs cp times too much: Megatron-LM #5047's mistake under context parallelism, which the control
    ``aux_scaled_for_token_group`` makes (:mod:`harness.recipes.controls.context_parallel`)."""

    name = "mesh_token_mean_with_load_balance"
    auxiliary_unit = "microbatch"

    def auxiliary_loss(self, model: nn.Module, batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        return load_balance(logits, _inputs(batch))

    def auxiliary_scale(self, window: Sequence[Batch], mesh: Any, tokens: int) -> float:
        return data_group_size(mesh) / data_microbatches(window, mesh)


class MeshTokenMeanWithZLoss(_MeshAuxiliary):
    """The token mean plus the z-loss (unit the token) on a mesh: a sum over each rank's own supervised positions (its
    cp chunk's), so its group is the main loss's, and its factor the main loss's, ``T / N``."""

    name = "mesh_token_mean_with_z_loss"
    auxiliary_unit = "token"

    def auxiliary_loss(self, model: nn.Module, batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        return z_loss(logits, batch)

    def auxiliary_scale(self, window: Sequence[Batch], mesh: Any, tokens: int) -> float:
        return token_group_size(mesh) / tokens


def data_microbatches(window: Sequence[Batch], mesh: Any) -> int:
    """``M``: the microbatches of every data coordinate's window, each once (counted over the data-parallel group; a
    mesh without a data-parallel dimension: this rank's window)."""
    if mesh is not None and data_group_size(mesh) == 1:
        return len(window)
    return global_count(len(window), group=data_group(mesh))


mesh_token_mean_with_load_balance = MeshTokenMeanWithLoadBalance()
mesh_token_mean_with_z_loss = MeshTokenMeanWithZLoss()

OBJECTIVE_RECIPES = {
    "harness.recipes.objectives:token_mean": "token_mean",
    "harness.recipes.objectives:sequence_mean": "sequence_mean",
    "harness.recipes.objectives:weighted_token_mean": "weighted_token_mean",
    "harness.recipes.objectives:fixed_normalizer": "fixed_normalizer",
    "harness.recipes.objectives:pg_token_mean": "token_mean",
    "harness.recipes.objectives:pg_sequence_mean": "sequence_mean",
    "harness.recipes.objectives:pg_fixed_normalizer": "fixed_normalizer",
    "harness.recipes.objectives:token_mean_with_load_balance": "token_mean",
    "harness.recipes.objectives:token_mean_with_z_loss": "token_mean",
    "harness.recipes.objectives:mesh_token_mean_with_load_balance": "token_mean",
    "harness.recipes.objectives:mesh_token_mean_with_z_loss": "token_mean",
}
"""Every correct recipe here and the objective it is right under."""


__all__ = ["OBJECTIVE_RECIPES", "FixedNormalizer", "MeshTokenMeanWithLoadBalance", "MeshTokenMeanWithZLoss",
           "PgFixedNormalizer", "PgSequenceMean", "PgTokenMean", "SequenceMean", "TokenMean",
           "TokenMeanWithLoadBalance", "TokenMeanWithZLoss", "WeightedTokenMean", "data_microbatches",
           "fixed_normalizer", "forward", "load_balance", "mesh_token_mean_with_load_balance",
           "mesh_token_mean_with_z_loss", "pg_fixed_normalizer", "pg_sequence_mean", "pg_token_mean", "sequence_ids",
           "sequence_mean", "supervised_sequences", "token_mean", "token_mean_with_load_balance",
           "token_mean_with_z_loss", "weighted_token_mean", "window_tokens", "z_loss"]
