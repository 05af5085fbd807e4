"""The reference arithmetic of a router auxiliary term in each unit, on a window small enough to compute by hand.

Five tokens of a router with E=2 experts and top-1 routing, whose probabilities are the parameters themselves (so each
gradient is read off the formula): rank 0 holds one microbatch of one row [t0, t1, t4]; rank 1 one microbatch of two
rows [t2], [t3].

    token   p(expert 0)  p(expert 1)  chosen
    t0      0.8          0.2          0
    t1      0.6          0.4          0
    t2      0.3          0.7          1
    t3      0.4          0.6          1
    t4      0.9          0.1          0

Switch's term over a set of tokens is ``E * sum_e f_e * P_e``. Rank 0's microbatch: f = (1, 0), P_0 = 2.3/3, so 2 x
2.3/3 = 1.5333; rank 1's: f = (0, 1), P_1 = 0.65, so 1.3. Rows [t2] and [t3]: 2 x 0.7 = 1.4 and 2 x 0.6 = 1.2.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from harness.core import router_terms as rt
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.core.objectives import Objective
from harness.core.reference import reference_gradient
from harness.moe import RouterOutput, load_balancing_loss
from harness.recipes.moe_terms import row_balance

PROBS = [[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.4, 0.6], [0.9, 0.1]]


class _Router(nn.Module):
    """A "model" whose router probabilities are its parameters, one row per token id."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(PROBS, dtype=torch.float64))


def _mb(rows: list[list[int]]) -> Microbatch:
    inputs = torch.tensor(rows, dtype=torch.int64)
    return Microbatch(inputs, inputs.clone())  # every position supervised (labels are never IGNORE_INDEX here)


WINDOW = [[_mb([[0, 1, 4]])], [_mb([[2], [3]])]]


def _output(model: nn.Module, mb: Microbatch) -> RouterOutput:
    probs = model.p[mb.inputs.reshape(-1)]
    return RouterOutput("router", probs, probs.detach().argmax(dim=-1, keepdim=True))


def _terms(unit: str) -> Callable[[nn.Module, Microbatch], tuple[torch.Tensor, object]]:
    """The reference's ``terms_of`` for ``unit``: no main loss, the term of the router outputs of ``mb``'s tokens."""

    def terms_of(model: nn.Module, mb: Microbatch) -> tuple[torch.Tensor, object]:
        out, mask = _output(model, mb), mb.labels != IGNORE_INDEX
        zero = model.p.sum() * 0.0  # no main loss: the reference's value is the term alone
        if unit == "microbatch":
            return zero, load_balancing_loss([out], mask)
        if unit == "token":
            return zero, int(mask.sum()) * load_balancing_loss([out], mask)
        if unit == "sequence":
            return zero, row_balance([out], mask).sum()
        return zero, [rt.statistics(out.probs, out.chosen, mask)]

    return terms_of


def _reference(unit: str) -> tuple[float, torch.Tensor]:
    ref = reference_gradient(_Router(), WINDOW, objective=Objective(auxiliary_unit=unit), terms_of=_terms(unit))
    return ref.loss, ref.gradient.view(5, 2)


def test_a_per_microbatch_term_is_averaged_over_every_microbatch_of_every_rank() -> None:
    """(1.5333 + 1.3) / 2 microbatches."""
    loss, _ = _reference("microbatch")
    assert pytest.approx((2 * 2.3 / 3 + 1.3) / 2, rel=1e-12) == loss


def test_a_per_token_term_weighs_each_microbatch_by_its_tokens_over_n() -> None:
    """(3 x 1.5333 + 2 x 1.3) / 5 tokens = 1.44."""
    loss, _ = _reference("token")
    assert pytest.approx(1.44, rel=1e-12) == loss


def test_a_per_sequence_term_is_each_row_s_own_term_averaged_over_the_sequences() -> None:
    """(1.5333 + 1.4 + 1.2) / 3 sequences; a token of row s weighs ``E * f_{s,e} / (n_s * S)``: 2/9 on t0's expert
    0 (row of 3 tokens), 2/3 on t2's and t3's expert 1 (rows of one)."""
    loss, grad = _reference("sequence")
    assert pytest.approx((2 * 2.3 / 3 + 1.4 + 1.2) / 3, rel=1e-12) == loss
    expected = torch.tensor([[2 / 9, 0], [2 / 9, 0], [0, 2 / 3], [0, 2 / 3], [2 / 9, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-15, rtol=0)  # float64 sums of five terms


def test_a_global_term_takes_its_fractions_and_probabilities_over_the_whole_window() -> None:
    """f = (3/5, 2/5), P = (3.0/5, 2.0/5): 2 x (0.36 + 0.16) = 1.04, where the microbatches' own terms average 1.4167;
    every token's gradient is ``E * f_e / N``: 0.24 on expert 0, 0.16 on expert 1."""
    loss, grad = _reference("global")
    assert pytest.approx(1.04, rel=1e-12) == loss
    expected = torch.tensor([[0.24, 0.16]] * 5, dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-15, rtol=0)  # float64 sums of five terms


def test_the_global_value_in_one_call_is_the_reference_s() -> None:
    """:func:`harness.core.router_terms.global_value` gives the same 1.04 from the two microbatches' statistics."""
    model = _Router()
    stats = [[rt.statistics(o.probs, o.chosen)] for o in (_output(model, mb) for rank in WINDOW for mb in rank)]
    assert pytest.approx(1.04, rel=1e-12) == float(rt.global_value(stats, 5).detach())


def test_each_unit_divides_by_its_own_count() -> None:
    """2 microbatches, 5 tokens, 3 sequences, 5 tokens."""
    got = {u: Objective(auxiliary_unit=u).auxiliary_denominator(WINDOW) for u in ("microbatch", "token", "sequence",
                                                                                   "global")}
    assert {"microbatch": 2.0, "token": 5.0, "sequence": 3.0, "global": 5.0} == got


def test_a_global_term_that_counts_other_tokens_than_the_supervised_ones_is_refused() -> None:
    """Statistics over 4 of 5 supervised tokens (one masked away) cannot be over N: the error names the mask."""
    def terms_of(model: nn.Module, mb: Microbatch) -> tuple[torch.Tensor, object]:
        out = _output(model, mb)
        mask = mb.inputs != 4
        return model.p.sum() * 0.0, [rt.statistics(out.probs, out.chosen, mask)]

    with pytest.raises(rt.DeclarationError, match=r"count the supervised tokens only \(mask labels != IGNORE_INDEX"):
        reference_gradient(_Router(), WINDOW, objective=Objective(auxiliary_unit="global"), terms_of=terms_of)


def test_a_global_term_that_returns_a_tensor_is_told_to_return_statistics() -> None:
    """Under the global unit a scalar cannot be combined over the window: the error names RouterStatistics (a
    DeclarationError, the recipe's to fix on any model)."""
    with pytest.raises(rt.DeclarationError, match=r"auxiliary_unit=.global. it returns the microbatch's router stat"):
        reference_gradient(_Router(), WINDOW, objective=Objective(auxiliary_unit="global"),
                           terms_of=_terms("microbatch"))


def test_an_unknown_unit_is_refused_naming_the_four() -> None:
    """The message lists every unit."""
    with pytest.raises(ValueError, match=r"must be one of microbatch, token, sequence, global"):
        Objective(auxiliary_unit="layer")
