"""Router auxiliary terms whose statistics span the whole window (``auxiliary_unit = "global"``), in arithmetic the
reference, the diagnosis and a recipe share.

The Switch load-balancing term of one MoE layer (E experts, top-K routing) over a set of tokens S is
``LB(S) = E * sum_e f_e(S) * P_e(S)``: ``f_e`` the fraction of the tokens' assignments that went to expert e
(``A_e / sum_e' A_e'``) and ``P_e`` the mean router probability of e over S. Megatron-LM's ``global_aux_loss`` takes S
to be every token of the global window, every data rank's and every microbatch's, so that a microbatch whose tokens
all chose one expert is not penalized when the window as a whole is balanced. Over the window G with N tokens:

    LB(G) = (1/N) * sum over microbatches m of  E * sum_e f_e(G) * S_e(m),      S_e(m) = sum over t in m of p_te

Only ``P`` carries a gradient (``f`` counts), so once ``f(G)`` is known the term is a sum over tokens with window-wide
coefficients ``E * f_e(G)``: each microbatch's *numerator* (:func:`global_numerator`) over N. What a microbatch gives
is therefore not one value but its statistics (:class:`RouterStatistics`, one per MoE layer): the sums of its
tokens' probabilities, with autograd, and its assignment counts. :func:`bind` turns them into numerators once a
first pass has summed every microbatch's assignments. The tokens counted are the window's supervised tokens (a
recipe masks ``labels != IGNORE_INDEX``), so N is the supervised count and :func:`bind` checks the assignments
against it.

This module is core arithmetic: no rank, no recipe, no model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from harness.core.microbatch import Microbatch
from harness.core.objectives import GLOBAL


@dataclass(frozen=True)
class RouterStatistics:
    """One MoE layer's statistics over one microbatch's counted tokens."""

    probability_sums: torch.Tensor
    """``[E]``: the sum over the counted tokens of each expert's router probability, with autograd."""
    assignments: torch.Tensor
    """``[E]``: how many of the counted tokens' top-K choices went to each expert (no gradient)."""
    coefficient: float = 1.0
    """The term's coefficient (the numerator is multiplied by it)."""

    def __post_init__(self) -> None:
        p, a = self.probability_sums, self.assignments
        if p.dim() != 1 or a.shape != p.shape:
            msg = (f"RouterStatistics: probability_sums {tuple(p.shape)} and assignments {tuple(a.shape)} must both "
                   "be [E], one entry per expert")
            raise ValueError(msg)


def statistics(probs: torch.Tensor, chosen: torch.Tensor, mask: torch.Tensor | None = None,
               coefficient: float = 1.0) -> RouterStatistics:
    """One layer's :class:`RouterStatistics` from its router output (``probs [tokens, E]`` with autograd, ``chosen
    [tokens, K]``) over the tokens where ``mask`` (bool, one entry per token) is True."""
    if mask is not None:
        keep = mask.reshape(-1).to(probs.device)
        if keep.numel() != probs.shape[0]:
            msg = (f"mask has {keep.numel()} entries and the router routed {probs.shape[0]} tokens: pass the mask of "
                   "the forward's own inputs")
            raise ValueError(msg)
        probs, chosen = probs[keep], chosen[keep]
    counts = torch.bincount(chosen.reshape(-1), minlength=probs.shape[1]).to(probs.dtype)
    return RouterStatistics(probs.sum(dim=0), counts, coefficient)


def window_fractions(per_microbatch: Iterable[Sequence[RouterStatistics]]) -> list[torch.Tensor]:
    """``f(G)`` of each layer (float64 ``[E]``): the assignments summed over every microbatch of the window, over their
    total (zeros for a layer that no counted token reached)."""
    totals: list[torch.Tensor] = []
    for stats in per_microbatch:
        if totals and len(stats) != len(totals):
            msg = f"router statistics of {len(stats)} layers after {len(totals)}: one entry per MoE layer, every time"
            raise ValueError(msg)
        for i, s in enumerate(stats):
            a = s.assignments.detach().to(torch.float64).cpu()
            if len(totals) <= i:
                totals.append(a.clone())
            else:
                totals[i] += a
    return [t / t.sum() if float(t.sum()) > 0 else t for t in totals]


def global_numerator(stats: Sequence[RouterStatistics], fractions: Sequence[torch.Tensor]) -> torch.Tensor:
    """One microbatch's numerator of the global term: the mean over layers of ``coefficient * E * sum_e f_e(G) *
    S_e(m)``. Over the window's N counted tokens, the numerators sum to the term."""
    if not stats or len(stats) != len(fractions):
        msg = f"{len(stats)} layers' statistics against {len(fractions)} layers' fractions: one per MoE layer"
        raise ValueError(msg)
    terms = [s.coefficient * s.probability_sums.shape[0] * (f.to(s.probability_sums) * s.probability_sums).sum()
             for s, f in zip(stats, fractions)]
    return torch.stack(terms).mean()


def global_value(per_microbatch: Sequence[Sequence[RouterStatistics]], tokens: float) -> torch.Tensor:
    """The global term over a window: every microbatch's numerator over the ``tokens`` counted (plain arithmetic, the
    reference's formula in one call)."""
    fractions = window_fractions(per_microbatch)
    return torch.stack([global_numerator(s, fractions) for s in per_microbatch]).sum() / tokens


class DeclarationError(TypeError):
    """A recipe's auxiliary term is not what its ``auxiliary_unit`` declares: the recipe's to fix, never the model's
    (a battery run reports it as the recipe's error, on any ``--model``)."""


Bound = Callable[[object], "torch.Tensor | None"]
"""What a microbatch's auxiliary value becomes in its window: a tensor to add over the unit's denominator."""


def bind(unit: str | None, statistics_of: Callable[[Microbatch], object],
         microbatches: Sequence[Microbatch]) -> Bound:
    """For ``unit`` ``"global"``: runs ``statistics_of(mb)`` (a microbatch's auxiliary value: its router statistics)
    without gradients over every microbatch of the window, sums their assignments into ``f(G)``, checks they count
    the window's supervised tokens, and returns what turns a microbatch's statistics into its numerator. Any other
    unit's value is already a tensor, returned as it is."""
    if unit != GLOBAL:
        return _scalar
    with torch.no_grad():
        seen = [_stats(statistics_of(mb)) for mb in microbatches]
    fractions = window_fractions(seen)
    tokens = sum(mb.supervised for mb in microbatches)
    for i in range(len(fractions)):
        total = float(sum(float(s[i].assignments.sum()) for s in seen))
        if tokens and (total < tokens or abs(total / tokens - round(total / tokens)) > 1e-9):
            msg = (f"auxiliary_unit='global': layer {i}'s router statistics count {total:g} assignments over the "
                   f"window's {tokens} supervised tokens, not K per token: count the supervised tokens only (mask "
                   "labels != IGNORE_INDEX; under cp the whole row's, all-reduced over the cp group)")
            raise DeclarationError(msg)
    return lambda value: global_numerator(_stats(value), fractions)


def _scalar(value: object) -> torch.Tensor | None:
    if value is not None and not isinstance(value, torch.Tensor):
        msg = (f"auxiliary_loss returned {type(value).__name__}: under auxiliary_unit 'microbatch', 'token' or "
               "'sequence' it returns one tensor; router statistics belong to auxiliary_unit = 'global'")
        raise DeclarationError(msg)
    return value


def _stats(value: object) -> Sequence[RouterStatistics]:
    if (isinstance(value, torch.Tensor) or not isinstance(value, Sequence) or not value
            or not all(isinstance(s, RouterStatistics) for s in value)):
        msg = (f"auxiliary_loss returned {type(value).__name__}: under auxiliary_unit='global' it returns the "
               "microbatch's router statistics, a list of harness.core.router_terms.RouterStatistics (one per MoE "
               "layer; router_terms.statistics(probs, chosen, mask) builds one), which the harness combines over the "
               "window")
        raise DeclarationError(msg)
    return value


__all__ = ["Bound", "DeclarationError", "RouterStatistics", "bind", "global_numerator", "global_value", "statistics",
           "window_fractions"]
