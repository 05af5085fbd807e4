"""The per-token losses an objective can weigh besides plain cross-entropy, on full (unsharded) logits: the
reference and the diagnosis compute them here, once. Each is ``[B, T]``, 0 where the label is ``IGNORE_INDEX``.

- :func:`smoothed_losses`, label smoothing with ``eps``: ``(1 - eps) * nll_t + eps * mean over the whole vocabulary of
  -log p_t(v)`` (what ``F.cross_entropy(..., label_smoothing=eps)`` computes on one device);
- :func:`entropies`, the entropy ``H(p_t) = -sum_v p_t(v) log p_t(v)`` of each position's prediction, which a policy
  loss with an entropy bonus subtracts, ``beta`` times, from ``-A_t * log p_t(y_t)``.

Plain cross-entropy stays :func:`harness.core.objectives.token_losses`: the existing objectives do not pass here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.core.microbatch import IGNORE_INDEX


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        msg = f"logits must be [B, T, V] and labels [B, T]; got {tuple(logits.shape)} and {tuple(labels.shape)}"
        raise ValueError(msg)


def check_fraction(name: str, value: object, where: str) -> float:
    """``value`` as a float if it is a real number in [0, 1); ValueError naming ``name``, the value and ``where`` it is
    declared otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= float(value) < 1:
        msg = f"{name}={value!r} must be a number in [0, 1): {where}"
        raise ValueError(msg)
    return float(value)


def smoothed_losses(logits: torch.Tensor, labels: torch.Tensor, eps: float) -> torch.Tensor:
    """Label-smoothed cross-entropy per token: ``(1 - eps) * nll + eps * mean_v(-log p(v))`` over all ``V`` classes,
    0 where not supervised."""
    _check(logits, labels)
    logp = F.log_softmax(logits, dim=-1)
    mask = labels != IGNORE_INDEX
    nll = -logp.gather(-1, torch.where(mask, labels, 0).unsqueeze(-1)).squeeze(-1)
    uniform = -logp.mean(dim=-1)
    return torch.where(mask, (1 - eps) * nll + eps * uniform, torch.zeros_like(nll))


def entropies(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The entropy of each supervised position's predicted distribution, ``-sum_v p(v) log p(v)``; 0 elsewhere."""
    _check(logits, labels)
    logp = F.log_softmax(logits, dim=-1)
    h = -(logp.exp() * logp).sum(dim=-1)
    return torch.where(labels != IGNORE_INDEX, h, torch.zeros_like(h))


__all__ = ["check_fraction", "entropies", "smoothed_losses"]
