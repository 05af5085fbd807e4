"""The diagnosis's readings of a per-token loss computed wrong on logits sharded over the vocabulary (tensor
parallelism with ``loss_parallel``), under the objectives whose per-token loss is not plain cross-entropy
(``label_smoothing``, ``entropy_bonus``: :data:`harness.core.objectives.TOKEN_LOSS_COEFFICIENTS`).

Each mistake is modelled on one device, on full logits, and its gradient over the window compared with the rank's
within the verdict's tolerances (as :func:`harness.diagnosis.objective.other_objective` does for another objective):

- ``smoothing_over_local_vocabulary``: the smoothing term's mean over the vocabulary divided by the local shard's size
  ``V / tp`` instead of ``V`` (Megatron-LM #737, #7464): the term weighs ``tp`` times too much;
- ``log_softmax_backward_dropped``: a log-prob, an entropy or a smoothing term built from ``log_softmax`` on the
  vocab-sharded logits under ``loss_parallel``, whose backward torch 2.13 replaces by the identity (pytorch #190746;
  measured in docs/objectives.md): modelled as ``z - logsumexp(z).detach()``, the right value with that gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from harness.core import objectives as ob
from harness.core import token_losses as tl
from harness.core.compare import compare, flat_grad
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.signatures import Signature

KEPT = frozenset({"correct", "float32_computation", "nonfinite", "weights_edited", "model_not_fixed",
                  "started_elsewhere"})
"""Readings this module never replaces: right, or a cause no per-token loss explains."""

Term = Callable[[torch.Tensor, Microbatch], torch.Tensor]
"""One microbatch's numerator term from its aligned logits, as a mistake computes it."""


def identity_backward_log_softmax(z: torch.Tensor) -> torch.Tensor:
    """``log_softmax(z)``'s value with the gradient ``loss_parallel`` gives it in torch 2.13: the identity (the
    softmax part ``-p * sum(grad)`` dropped)."""
    return z - torch.logsumexp(z, dim=-1, keepdim=True).detach()


def _mask(mb: Microbatch) -> torch.Tensor:
    return mb.labels != IGNORE_INDEX


def _smoothed(eps: float, uniform: Callable[[torch.Tensor], torch.Tensor]) -> Term:
    def term(z: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        nll = ob.token_losses(z, mb.labels)
        return (((1 - eps) * nll + eps * uniform(z)) * _mask(mb)).sum()
    return term


def _policy(beta: float, wrong_log_prob: bool, wrong_entropy: bool) -> Term:
    def term(z: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        mask = _mask(mb)
        a = mb.weights.to(z.dtype) if mb.weights is not None else torch.ones_like(z[..., 0])
        if wrong_log_prob:
            idx = torch.where(mask, mb.labels, 0).unsqueeze(-1)
            logp = identity_backward_log_softmax(z).gather(-1, idx).squeeze(-1)
        else:
            logp = -ob.token_losses(z, mb.labels)
        if wrong_entropy:
            lp = identity_backward_log_softmax(z)
            h = -(lp.exp() * lp).sum(dim=-1)
        else:
            h = tl.entropies(z, mb.labels)
        return ((-a * logp - beta * h) * mask).sum()
    return term


def mistakes(objective: ob.Objective, tp: int) -> list[tuple[str, str, Term]]:
    """``(signature, what was computed, its term)`` of every mistake modelled under ``objective`` on a mesh whose
    tp size is ``tp`` (none without tp: ``loss_parallel`` shards nothing there)."""
    c = float(objective.coefficient or 0.0)
    if tp < 2 or objective.name not in ob.TOKEN_LOSS_COEFFICIENTS:
        return []
    if objective.name == ob.LABEL_SMOOTHING:
        return [
            ("smoothing_over_local_vocabulary",
             f"the smoothing term's mean over the vocabulary divided by the local shard's size V/tp (tp={tp}) "
             "instead of V: it weighs tp times too much",
             _smoothed(c, lambda z: tp * (torch.logsumexp(z, dim=-1) - z.mean(dim=-1)))),
            ("log_softmax_backward_dropped",
             "the smoothing term computed from log_softmax on the vocab-sharded logits under loss_parallel",
             _smoothed(c, lambda z: -identity_backward_log_softmax(z).mean(dim=-1))),
        ]
    out = []
    for logp, ent, what in ((True, True, "the token log-probs (log_softmax(logits).gather(...)) and the entropy"),
                            (True, False, "the token log-probs (log_softmax(logits).gather(...))"),
                            (False, True, "the entropy")):
        out.append(("log_softmax_backward_dropped",
                    f"{what} computed from log_softmax on the vocab-sharded logits under loss_parallel",
                    _policy(c, logp, ent)))
    return out


def _gradient(ev: Evidence, model: torch.nn.Module, window: int, term: Term, z: float) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    for rank in ev.windows[window]:
        for mb in rank:
            if mb.supervised:
                _, aligned = ev.model.logits(model, mb)
                (term(aligned, mb) / z).backward()
    return flat_grad(model)


def loss_parallel_reading(ev: Evidence, window: int, model: torch.nn.Module, sig: Signature, g: torch.Tensor,
                          atol: float, rtol: float) -> Signature | None:
    """The mistake of :func:`mistakes` whose gradient ``g`` is, within the verdict's tolerances; None when none is
    (or the reading already names what no per-token loss explains)."""
    if sig.name in KEPT:
        return None
    found = mistakes(ev.objective, ev.mesh.size("tp"))
    if not found:
        return None
    z = ev.objective.window_normalizer(ev.windows[window])
    if not math.isfinite(z) or z <= 0:
        return None
    for name, what, term in found:
        if compare(g, _gradient(ev, model, window, term, z), atol=atol, rtol=rtol).passed:
            why = ("torch 2.13's loss_parallel replaces log_softmax's backward by the identity (pytorch #190746), so "
                   "its gradient loses the softmax part" if name == "log_softmax_backward_dropped" else
                   "Megatron-LM #737's mistake")
            return Signature(name, f"this gradient is {ev.objective.describe()} with {what}: {why}", 1.0)
    return None


__all__ = ["identity_backward_log_softmax", "loss_parallel_reading", "mistakes"]
