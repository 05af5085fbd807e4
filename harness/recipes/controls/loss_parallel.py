"""Negative controls, vocabulary-parallel family: per-token losses computed wrong on logits sharded over the
vocabulary under tensor parallelism (``loss_parallel``), each under the objective whose per-token loss it breaks.

Each runs with the head's logits left sharded on the vocabulary (``tp_plan``:
:func:`harness.distributed.tensor_parallel.vocab_parallel_plan`) under FSDP2 over dp (``--mesh dp=2,tp=2 --strategy
fsdp2``) and differs from its correct twin in :mod:`harness.recipes.vocab_parallel` by its one mistake; at ``dp=W``
(nothing sharded) each is right."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.vocab_parallel import LabelSmoothedTokenMean, PolicyEntropyTokenMean, _local, token_log_probs

TP_MESH = "dp=2,tp=2"
"""The mesh both controls are judged on: two data coordinates, the vocabulary sharded over two tp ranks."""


def _target(objective: str) -> Target:
    return Target("parity", "uneven", strategy="fsdp2", mesh=TP_MESH, objective=objective)


@control(_target("label_smoothing"), "smoothing_over_local_vocabulary")
class SmoothingOverLocalVocabulary(LabelSmoothedTokenMean):
    """Megatron-LM #737 (and #7464; PRs #5522, #7466): the label-smoothing term's sum of ``-log p`` over the
    vocabulary divided by the vocabulary size read off this rank's shard of the logits (``V / tp``), not the whole
    vocabulary's ``V``: the smoothing weighs ``tp`` times what it should. Right where nothing is sharded."""

    name = "smoothing_over_local_vocabulary"

    def token_losses(self, logits: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        eps = self.label_smoothing
        to_local = getattr(logits, "to_local", None)
        local_vocab = (to_local() if to_local is not None else logits).shape[-1]
        # sum_v -log p(v) = V * logsumexp(z) - sum_v z_v, over the whole vocabulary (a DTensor's shape is global)
        summed = _local(logits.shape[-1] * torch.logsumexp(logits, dim=-1) - logits.sum(dim=-1))
        return -(1 - eps) * token_log_probs(logits, mb.labels) + eps * summed / local_vocab


@control(_target("entropy_bonus"), "log_softmax_backward_dropped")
class LogSoftmaxGatherUnderLossParallel(PolicyEntropyTokenMean):
    """pytorch #190746: token log-probs as ``log_softmax(logits, -1).gather(-1, labels)`` and the entropy bonus from
    the same ``log_softmax``, on vocab-sharded logits inside ``loss_parallel()``. The values are right; the gradient
    is not: in torch 2.13 ``loss_parallel`` replaces ``log_softmax``'s backward by the identity (its fused backward
    lives in ``cross_entropy``'s), so both terms lose the softmax part of their gradient."""

    name = "log_softmax_gather_under_loss_parallel"

    def token_losses(self, logits: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        logp = F.log_softmax(logits, dim=-1)
        index = torch.where(mb.labels != IGNORE_INDEX, mb.labels, 0).unsqueeze(-1)
        mesh = getattr(logits, "device_mesh", None)
        if mesh is not None:  # DTensor's gather takes a DTensor index; the full tensor before the squeeze
            from torch.distributed.tensor import DTensor, Replicate

            index = DTensor.from_local(index, mesh, [Replicate()])
        picked = _local(logp.gather(-1, index)).squeeze(-1)
        entropy = _local(-(logp.exp() * logp).sum(dim=-1))
        advantages = mb.weights if mb.weights is not None else torch.ones_like(picked)
        return -advantages.to(picked.dtype) * picked - self.entropy_coefficient * entropy
