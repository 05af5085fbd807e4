"""The declared objective: which weighting of the per-token losses a training step optimizes, written once.

Every objective is one formula over the *global* window (every rank's microbatches of one optimizer step)::

    L = (sum over supervised tokens t of c_t * w_t * l_t) / Z

``l_t`` is token t's cross-entropy, ``w_t`` its factor carried by the batch (``Microbatch.weights``: drawn weights, or
a policy-gradient recipe's advantages; 1 when the batch carries none), ``c_t`` the objective's own coefficient and
``Z`` its normalizer, a quantity of the whole window that each rank only knows after an all-reduce:

=====================  =========================  =====================================================
objective              ``c_t``                    ``Z`` (all-reduced SUM of each rank's share)
=====================  =========================  =====================================================
``token_mean``         1                          N, the supervised tokens
``sequence_mean``      1 / n_s (its row's count)  S, the rows holding at least one supervised token
``weighted_token_mean``  1                        the sum of ``w_t`` over supervised tokens
``fixed_normalizer``   1                          a constant the recipe declares (``normalizer``)
``label_smoothing``    1                          N (``l_t`` label-smoothed, ``eps`` = ``label_smoothing``)
``entropy_bonus``      1                          N (``l_t = -A_t log p(y_t) - beta H(p_t)``)
=====================  =========================  =====================================================

The last two change the per-token loss itself (:mod:`harness.core.token_losses`), with a coefficient the recipe
declares (:attr:`Objective.coefficient`): label smoothing ``eps``, ``(1 - eps) * nll_t + eps * mean_v(-log p_t(v))``
over the whole vocabulary; the policy loss with an entropy bonus ``beta``, its advantages ``A_t`` drawn like a
``token_weights = "advantages"`` recipe's (:meth:`Objective.term`).

DDP averages gradients over W ranks, so under every objective rank r backpropagates
``W * (sum of c_t * w_t * l_t over its own tokens) / Z``: the W cancels DDP's division, and Z is the same on every
rank. Each objective is right for itself and wrong for the others; where every row holds the same count they coincide,
which is why the battery's windows never do.

An auxiliary term (:data:`AUXILIARY_UNITS`) has its own unit: ``"microbatch"``, one value per microbatch averaged over
every microbatch of every rank (a load-balancing loss; weight decay written into the loss), or ``"token"``, a sum over
a microbatch's supervised tokens divided by N (a z-loss). It is added to ``L`` with that normalization, whatever the
main objective's.

The worked example (``docs/objectives.md``): rank 0 holds three sequences of 4 tokens of loss 1, rank 1 three of 12
tokens of loss 3. The token mean is (12 + 108) / 48 = 2.5; the sequence mean (1 + 1 + 1 + 3 + 3 + 3) / 6 = 2.
:func:`objective_value` computes both from the same numbers (``tests/unit/test_objectives.py``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.core.objective_names import (
    ENTROPY_BONUS,
    FIXED_NORMALIZER,
    LABEL_SMOOTHING,
    OBJECTIVES,
    SEQUENCE_MEAN,
    TOKEN_MEAN,
    WEIGHTED_TOKEN_MEAN,
    check_objective,
)

DESCRIPTIONS = {
    TOKEN_MEAN: "the token mean (every supervised token of the global window weighs 1/N)",
    SEQUENCE_MEAN: "the sequence mean (each sequence with a supervised token weighs 1/S, its tokens share it)",
    WEIGHTED_TOKEN_MEAN: "the weighted token mean (token t weighs w_t / the global weight sum)",
    FIXED_NORMALIZER: "the loss sum over a fixed constant (every supervised token weighs 1/C)",
    LABEL_SMOOTHING: "the token mean of label-smoothed cross-entropy ((1 - eps) nll + eps mean over the vocabulary of "
                     "-log p)",
    ENTROPY_BONUS: "the token mean of a policy loss with an entropy bonus (-A log p(y) - beta H(p))",
}
"""Each objective in words, as the diagnosis names it."""

QUANTITIES = {
    TOKEN_MEAN: "the global supervised count",
    SEQUENCE_MEAN: "the global count of sequences with a supervised token",
    WEIGHTED_TOKEN_MEAN: "the global weight sum",
    FIXED_NORMALIZER: "the declared constant",
    LABEL_SMOOTHING: "the global supervised count",
    ENTROPY_BONUS: "the global supervised count",
}
"""What each objective's normalizer ``Z`` is."""

WEIGHTS = "weights"
ADVANTAGES = "advantages"
TOKEN_WEIGHTS = (WEIGHTS, ADVANTAGES)
"""What the harness draws into ``Microbatch.weights``: non-negative weights with zeros (``weighted_token_mean``), or
signed advantages (a recipe that declares ``token_weights = "advantages"``)."""

MICROBATCH = "microbatch"
TOKEN = "token"
SEQUENCE = "sequence"
GLOBAL = "global"
AUXILIARY_UNITS = (MICROBATCH, TOKEN, SEQUENCE, GLOBAL)
"""The units an auxiliary term may declare (``auxiliary_unit``): one value per microbatch, averaged over the window's
microbatches; a sum over supervised tokens over N; a sum of per-sequence values over S, the sequences with a
supervised token; a router term whose statistics are the whole window's (``auxiliary_loss`` returns the microbatch's
:class:`harness.core.router_terms.RouterStatistics`), over N (docs/objectives.md, "Router auxiliary terms")."""

TOKEN_LOSS_COEFFICIENTS = {LABEL_SMOOTHING: "label_smoothing", ENTROPY_BONUS: "entropy_coefficient"}
"""The objectives whose per-token loss is not plain cross-entropy, and the attribute a recipe declares their
coefficient in (:attr:`Objective.coefficient`). Each is normalized like the token mean."""


@dataclass(frozen=True)
class Objective:
    """A declared objective, resolved for one recipe: its ``name``, the constant of ``fixed_normalizer``, what the
    batch's ``weights`` hold (None: no weights), and the unit of the recipe's auxiliary term (None: none). Hashable
    and picklable: it keys the reference chains and travels with a run."""

    name: str = TOKEN_MEAN
    normalizer: float | None = None
    weights: str | None = None
    auxiliary_unit: str | None = None
    auxiliary_recipe: str | None = None
    """The recipe whose ``auxiliary_loss`` the reference calls (its import path), when it declares one."""
    coefficient: float | None = None
    """The per-token loss's own coefficient (:data:`TOKEN_LOSS_COEFFICIENTS`): ``label_smoothing``'s ``eps``,
    ``entropy_bonus``'s ``beta``; None under the objectives of plain cross-entropy."""

    def __post_init__(self) -> None:
        check_objective(self.name, "objective")
        if self.name == FIXED_NORMALIZER:
            n = self.normalizer
            if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n) or n <= 0:
                msg = (f"normalizer={n!r}: under objective=fixed_normalizer the recipe declares the positive constant "
                       "its loss sum is divided by, as a class attribute (normalizer = 1024.0)")
                raise ValueError(msg)
        if self.weights is not None and self.weights not in TOKEN_WEIGHTS:
            msg = f"token_weights={self.weights!r} must be one of {', '.join(TOKEN_WEIGHTS)}, or absent"
            raise ValueError(msg)
        if self.name == WEIGHTED_TOKEN_MEAN and self.weights == ADVANTAGES:
            msg = ("objective=weighted_token_mean divides by the weight sum, and advantages are signed (their sum may "
                   "be 0): judge an advantage-weighted loss with token_mean, sequence_mean or fixed_normalizer")
            raise ValueError(msg)
        if self.name in TOKEN_LOSS_COEFFICIENTS:
            c = self.coefficient
            if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or not 0 <= c < 1:
                msg = (f"{TOKEN_LOSS_COEFFICIENTS[self.name]}={c!r}: under objective={self.name} the recipe declares "
                       "its coefficient, a number in [0, 1), as a class attribute (docs/objectives.md)")
                raise ValueError(msg)
        if self.auxiliary_unit is not None and self.auxiliary_unit not in AUXILIARY_UNITS:
            msg = (f"auxiliary_unit={self.auxiliary_unit!r} must be one of {', '.join(AUXILIARY_UNITS)}: one value "
                   "per microbatch averaged over the window's microbatches, a sum over supervised tokens over N, a sum "
                   "over sequences over S, or router statistics of the whole window over N (docs/objectives.md)")
            raise ValueError(msg)

    @property
    def plain(self) -> bool:
        """The token mean of plain cross-entropy, with nothing added: the harness's original objective."""
        return self.name == TOKEN_MEAN and self.weights is None and self.auxiliary_unit is None

    def describe(self) -> str:
        text = DESCRIPTIONS[self.name]
        if self.name == FIXED_NORMALIZER:
            text = text.replace("a fixed constant", f"the declared constant C={self.normalizer:g}")
        if self.weights == ADVANTAGES and self.name != ENTROPY_BONUS:  # its own words name the advantages
            text += ", of the advantage-weighted loss"
        return text

    # -- the formula, per microbatch and per window -----------------------------------------------------------------

    def coefficients(self, mb: Microbatch) -> torch.Tensor:
        """``c_t * w_t`` for every position of ``mb`` (float64 ``[B, T]``, 0 where not supervised): the microbatch's
        term of the numerator is ``(coefficients * per-token loss).sum()``."""
        return coefficients(self.name, mb, self.weights is not None)

    def term(self, logits: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        """``mb``'s term of the numerator from its aligned logits ``[B, T, V]``: ``sum_t c_t * w_t * l_t`` with the
        objective's per-token loss ``l_t`` (plain cross-entropy but for the objectives of
        :data:`TOKEN_LOSS_COEFFICIENTS`), in the logits' dtype."""
        from harness.core import token_losses as tl

        if self.name == LABEL_SMOOTHING:
            return objective_term(tl.smoothed_losses(logits, mb.labels, float(self.coefficient or 0.0)), mb,
                                  self.name, False)
        ce = objective_term(token_losses(logits, mb.labels), mb, self.name, self.weights is not None)
        if self.name == ENTROPY_BONUS:  # the advantages weigh the log-prob only; the bonus is every token's alike
            return ce - float(self.coefficient or 0.0) * objective_term(tl.entropies(logits, mb.labels), mb,
                                                                         self.name, False)
        return ce

    def share(self, window: Sequence[Microbatch]) -> float:
        """This rank's share of the all-reduced quantity ``Z`` (its count, rows or weight sum; 0 for a constant)."""
        return float(sum(share(self.name, mb) for mb in window))

    def normalizer_of(self, total: float) -> float:
        """``Z`` from the all-reduced sum of every rank's :meth:`share` (the declared constant for a fixed one)."""
        return float(self.normalizer) if self.name == FIXED_NORMALIZER else float(total)  # type: ignore[arg-type]

    def window_normalizer(self, windows: Sequence[Sequence[Microbatch]]) -> float:
        """``Z`` of a global window ``windows[rank][microbatch]``."""
        return self.normalizer_of(sum(self.share(w) for w in windows))

    def auxiliary_denominator(self, windows: Sequence[Sequence[Microbatch]]) -> float:
        """What the auxiliary term's values are divided by: every microbatch of every rank (``microbatch``), the
        global count of sequences with a supervised token (``sequence``), or the global supervised count (``token``,
        ``global``)."""
        if self.auxiliary_unit == MICROBATCH:
            return float(sum(len(w) for w in windows))
        if self.auxiliary_unit == SEQUENCE:
            return float(sum(share(SEQUENCE_MEAN, mb) for w in windows for mb in w))
        return float(sum(mb.supervised for w in windows for mb in w))


PLAIN = Objective()
"""The default: the token mean of plain cross-entropy."""


def coefficients(name: str, mb: Microbatch, weighted: bool = True) -> torch.Tensor:
    """``c_t * w_t`` of objective ``name`` over ``mb`` (see :meth:`Objective.coefficients`); ``weighted`` False reads
    the plain loss of a batch that carries weights (every ``w_t`` 1)."""
    mask = (mb.labels != IGNORE_INDEX).to(torch.float64)
    w = mask if mb.weights is None or not weighted else mb.weights.to(torch.float64) * mask
    if name == SEQUENCE_MEAN:
        # Each row's tokens share its one weight: divided by the row's own supervised count (a row without one
        # contributes nothing, and counts for nothing in S); a part of a row (a cp chunk's block) by its whole's.
        counts = mask.sum(dim=1) if mb.counts is None else mb.counts.to(torch.float64)
        return w / counts.unsqueeze(1).clamp(min=1)
    return w


def share(name: str, mb: Microbatch) -> float:
    """One microbatch's part of objective ``name``'s normalizer ``Z``."""
    mask = mb.labels != IGNORE_INDEX
    if name in (TOKEN_MEAN, LABEL_SMOOTHING, ENTROPY_BONUS):
        return float(mask.sum())
    if name == SEQUENCE_MEAN:
        return float((mask.sum(dim=1) > 0).sum())
    if name == WEIGHTED_TOKEN_MEAN:
        w = torch.ones_like(mask, dtype=torch.float64) if mb.weights is None else mb.weights.to(torch.float64)
        return float((w * mask).sum())
    return 0.0


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``[B, T]`` of aligned logits ``[B, T, V]``, 0 where ``labels`` is ``IGNORE_INDEX``."""
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        msg = f"logits must be [B, T, V] and labels [B, T]; got {tuple(logits.shape)} and {tuple(labels.shape)}"
        raise ValueError(msg)
    flat = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                             reduction="none")
    return flat.view(labels.shape)


def objective_term(losses: torch.Tensor, mb: Microbatch, name: str, weighted: bool = True) -> torch.Tensor:
    """One microbatch's term of the numerator: ``sum_t c_t * w_t * l_t``, in the losses' dtype."""
    return (coefficients(name, mb, weighted).to(losses.dtype) * losses).sum()


# -- drawing the batch's factors ------------------------------------------------------------------------------------

DRAW_SEED = 2311
"""The generator seed of the drawn weights and advantages (the same windows draw the same factors in every process)."""


def draw(mb: Microbatch, kind: str, gen: torch.Generator) -> Microbatch:
    """``mb`` carrying drawn factors: ``weights`` from {0, 0.5, 1, 1.5, 2} (a quarter zeros, and one row in three
    entirely zero), ``advantages`` from -2 to 2 in quarters. Both are exact in float32, so the float32 and float64
    lanes judge the same numbers; 0 where not supervised."""
    mask = mb.labels != IGNORE_INDEX
    shape = mb.labels.shape
    if kind == WEIGHTS:
        values = torch.randint(0, 5, shape, generator=gen).to(torch.float64) * 0.5
        zero_rows = torch.randint(0, 3, (shape[0], 1), generator=gen) == 0
        values = torch.where(zero_rows, torch.zeros_like(values), values)
    elif kind == ADVANTAGES:
        values = torch.randint(-8, 9, shape, generator=gen).to(torch.float64) / 4
    else:
        msg = f"kind={kind!r} must be one of {', '.join(TOKEN_WEIGHTS)}"
        raise ValueError(msg)
    return Microbatch(mb.inputs, mb.labels, torch.where(mask, values, torch.zeros_like(values)))


def with_factors(windows: Sequence[Sequence[Sequence[Microbatch]]], kind: str,
                 seed: int = DRAW_SEED) -> list[list[list[Microbatch]]]:
    """``windows[k][rank][microbatch]`` with drawn factors (:func:`draw`) where a microbatch carries none. A window
    whose tokens would all weigh 0 gets weight 1 on its first supervised token: a zero weight sum over supervised
    tokens is the empty window's case, which the battery's ``all_empty`` scenario owns."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for window in windows:
        drawn = [[mb if mb.weights is not None else draw(mb, kind, gen) for mb in rank] for rank in window]
        if kind == WEIGHTS and not any(share(WEIGHTED_TOKEN_MEAN, mb) > 0 for rank in drawn for mb in rank):
            for r, rank in enumerate(drawn):
                hit = next((m for m, mb in enumerate(rank) if mb.supervised), None)
                if hit is not None:
                    mb = rank[hit]
                    w = mb.weights.clone()  # type: ignore[union-attr]
                    first = (mb.labels != IGNORE_INDEX).flatten().nonzero()[0]
                    w.view(-1)[first] = 1.0
                    drawn[r][hit] = Microbatch(mb.inputs, mb.labels, w)
                    break
        out.append(drawn)
    return out


# -- plain arithmetic: the worked examples ----------------------------------------------------------------------------

Token = float | tuple[float, float]
"""A supervised token's loss, or ``(loss, weight)``."""


def objective_value(name: str, ranks: Sequence[Sequence[Sequence[Token]]], normalizer: float | None = None) -> float:
    """Objective ``name`` over ``ranks[rank][sequence][token]`` (every token supervised; a token is its loss or
    ``(loss, weight)``), as plain arithmetic: the formula of the module's docstring without a tensor or a rank."""
    check_objective(name, "name")
    numerator, z = 0.0, 0.0
    for rank in ranks:
        for seq in rank:
            pairs = [(t, 1.0) if isinstance(t, (int, float)) else (float(t[0]), float(t[1])) for t in seq]
            if not pairs:
                continue
            c = 1 / len(pairs) if name == SEQUENCE_MEAN else 1.0
            numerator += sum(c * w * loss for loss, w in pairs)
            z += {TOKEN_MEAN: len(pairs), LABEL_SMOOTHING: len(pairs), ENTROPY_BONUS: len(pairs), SEQUENCE_MEAN: 1,
                  WEIGHTED_TOKEN_MEAN: sum(w for _, w in pairs)}.get(name, 0)
    if name == FIXED_NORMALIZER:
        if normalizer is None or normalizer <= 0:
            msg = f"normalizer={normalizer!r}: fixed_normalizer divides by a positive constant; pass it"
            raise ValueError(msg)
        z = normalizer
    if z == 0:
        msg = f"objective {name}: the window's normalizer is 0 (no supervised token, or every weight 0)"
        raise ValueError(msg)
    return numerator / z


__all__ = ["ADVANTAGES", "AUXILIARY_UNITS", "DESCRIPTIONS", "ENTROPY_BONUS", "FIXED_NORMALIZER", "GLOBAL",
           "LABEL_SMOOTHING", "MICROBATCH", "OBJECTIVES", "PLAIN", "QUANTITIES", "SEQUENCE", "SEQUENCE_MEAN", "TOKEN",
           "TOKEN_LOSS_COEFFICIENTS", "TOKEN_MEAN", "TOKEN_WEIGHTS", "WEIGHTED_TOKEN_MEAN", "WEIGHTS", "Objective",
           "check_objective", "coefficients", "draw", "objective_term", "objective_value", "share", "token_losses",
           "with_factors"]
