"""Correct recipes with the head's logits sharded on the vocabulary under tensor parallelism, their loss computed
inside ``torch.distributed.tensor.parallel.loss_parallel()`` (torchtitan's layout): the token mean, label-smoothed
cross-entropy (``--objective=label_smoothing``) and a policy loss with an entropy bonus (``--objective=entropy_bonus``).

Each declares the plan that leaves the logits a DTensor sharded on the vocabulary (``tp_plan``:
:func:`harness.distributed.tensor_parallel.vocab_parallel_plan`, which the harness applies instead of the model's),
and runs unchanged at ``dp=W``, where the logits are a plain tensor::

    python -m harness battery --mesh dp=2,tp=2 --strategy fsdp2 --objective label_smoothing \\
        --recipe harness.recipes.vocab_parallel:label_smoothed_token_mean

What is right under ``loss_parallel`` in torch 2.13 (measured, docs/objectives.md): ``F.cross_entropy`` with
``reduction="none"`` or ``"sum"`` (its own fused backward), ``torch.logsumexp`` and ``softmax`` on the sharded
logits. What is wrong: ``F.log_softmax`` outside ``cross_entropy``, whose backward ``loss_parallel`` replaces by the
identity (pytorch #190746), so a log-prob ``log_softmax(logits).gather(...)``, an entropy or a smoothing term built
from it gets a gradient without its softmax part; and ``cross_entropy(..., label_smoothing=eps)`` raises. Token
log-probs are therefore ``-cross_entropy(logits, labels, reduction="none")``, the smoothing term ``logsumexp(z) -
mean_v(z)`` and the entropy ``logsumexp(z) - sum_v softmax(z)_v z_v``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.core.formats import logits_of, supervised_tokens
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.distributed.tensor_parallel import vocab_parallel_plan
from harness.recipes.helpers import (
    global_count,
    global_sum,
    require_tokens,
    sync_context,
    token_group,
    token_group_size,
)


def vocab_sharded(logits: torch.Tensor) -> bool:
    """Whether ``logits`` is a DTensor sharded on its last (vocabulary) dimension."""
    placements = getattr(logits, "placements", ())
    return any(getattr(p, "dim", None) in (-1, logits.dim() - 1) for p in placements)


def loss_context(logits: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """``loss_parallel()`` for vocab-sharded logits (the loss and its backward both belong inside), else nothing."""
    if not vocab_sharded(logits):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A per-token DTensor as the plain tensor every tp rank holds alike: ``full_tensor()``, never ``to_local()``,
    since a reduction over the sharded vocabulary (``mean``) is left ``Partial``, each rank's local part a share."""
    full = getattr(t, "full_tensor", None)
    return t if full is None else full()


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p(y_t)`` per token ``[B, T]`` (0 where not supervised) as ``-cross_entropy(..., reduction="none")``:
    right on vocab-sharded logits under ``loss_parallel``, where ``log_softmax(...).gather(...)`` is not."""
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return -_local(ce).view(labels.shape)


def smoothing_terms(logits: torch.Tensor) -> torch.Tensor:
    """The mean over the whole vocabulary of ``-log p(v)`` at every position ``[B, T]``: ``logsumexp(z) - mean(z)``,
    the vocabulary size the global one (a DTensor's shape is the global shape)."""
    return _local(torch.logsumexp(logits, dim=-1) - logits.mean(dim=-1))


def token_entropies(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of every position's prediction ``[B, T]``: ``logsumexp(z) - sum_v softmax(z)_v * z_v``."""
    return _local(torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1))


class _VocabParallel:
    """The loop the recipes here share: the count over the token group before any backward, each microbatch's term
    of the numerator times the token group's size over that count, forward, loss and backward of a vocab-sharded
    head inside ``loss_parallel()``. A recipe says what a microbatch's per-token losses are (:meth:`token_losses`)."""

    name = "vocab_parallel"
    tp_plan = staticmethod(vocab_parallel_plan)

    def token_losses(self, logits: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        """Per-token losses ``[B, T]`` of one microbatch (a plain tensor; anything at unsupervised positions)."""
        raise NotImplementedError

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch], mesh: Any = None) -> float | None:
        group, size = token_group(mesh), token_group_size(mesh)
        total = require_tokens(global_count(sum(supervised_tokens(mb) for mb in window), group=group))
        local = 0.0
        for i, mb in enumerate(window):
            with sync_context(model, i, len(window)):
                logits = logits_of(model(mb.inputs))
                with loss_context(logits):  # the backward too: loss_parallel's own backward runs only inside it
                    term = (self.token_losses(logits, mb) * (mb.labels != IGNORE_INDEX)).sum()
                    (term * (size / total)).backward()
            local += float(term.detach())
        # Every tp rank of a token coordinate holds the same sum: the logged loss is reduced over the token group.
        return global_sum(local, group) / total


class VocabParallelTokenMean(_VocabParallel):
    """The token mean of cross-entropy on vocab-sharded logits: ``cross_entropy(..., reduction="none")`` under
    ``loss_parallel``, summed, over the count all-reduced over the token group."""

    name = "vocab_parallel_token_mean"

    def token_losses(self, logits: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        return -token_log_probs(logits, mb.labels)


class LabelSmoothedTokenMean(_VocabParallel):
    """Label-smoothed cross-entropy, token mean: ``(1 - eps) * nll + eps * mean over the whole vocabulary of -log p``,
    eps = :attr:`label_smoothing` (``--objective=label_smoothing``)."""

    name = "label_smoothed_token_mean"
    label_smoothing = 0.1

    def token_losses(self, logits: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        eps = self.label_smoothing
        return -(1 - eps) * token_log_probs(logits, mb.labels) + eps * smoothing_terms(logits)


class PolicyEntropyTokenMean(_VocabParallel):
    """A policy loss with an entropy bonus, token mean: ``-A_t * log p(y_t) - beta * H(p_t)``, A the advantages the
    harness draws into ``Microbatch.weights``, beta = :attr:`entropy_coefficient` (``--objective=entropy_bonus``)."""

    name = "policy_entropy_token_mean"
    token_weights = "advantages"
    entropy_coefficient = 0.01

    def token_losses(self, logits: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        advantages = mb.weights if mb.weights is not None else torch.ones_like(mb.labels, dtype=logits.dtype)
        logp = token_log_probs(logits, mb.labels)
        return -advantages.to(logp.dtype) * logp - self.entropy_coefficient * token_entropies(logits)


vocab_parallel_token_mean = VocabParallelTokenMean()
label_smoothed_token_mean = LabelSmoothedTokenMean()
policy_entropy_token_mean = PolicyEntropyTokenMean()

VOCAB_PARALLEL_RECIPES = {
    "harness.recipes.vocab_parallel:vocab_parallel_token_mean": "token_mean",
    "harness.recipes.vocab_parallel:label_smoothed_token_mean": "label_smoothing",
    "harness.recipes.vocab_parallel:policy_entropy_token_mean": "entropy_bonus",
}
"""Every correct recipe here and the objective it is right under."""

__all__ = ["VOCAB_PARALLEL_RECIPES", "LabelSmoothedTokenMean", "PolicyEntropyTokenMean", "VocabParallelTokenMean",
           "label_smoothed_token_mean", "loss_context", "policy_entropy_token_mean", "smoothing_terms",
           "token_entropies", "token_log_probs", "vocab_parallel_token_mean", "vocab_sharded"]
