"""The per-token losses of ``label_smoothing`` and ``entropy_bonus`` against hand computation, the numerator every
other objective keeps bit for bit, the coefficient a recipe must declare, and the one-device model of
``loss_parallel``'s log_softmax backward the diagnosis reads (``harness.core.token_losses``,
``harness.diagnosis.loss_parallel``)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.battery.prepare.objective import resolve
from harness.core import objectives as ob
from harness.core import token_losses as tl
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.diagnosis.loss_parallel import identity_backward_log_softmax, mistakes

# One row of two positions over a vocabulary of 3; the second position is not supervised.
LOGITS = torch.tensor([[[0.0, math.log(2.0), math.log(5.0)], [1.0, 2.0, 3.0]]], dtype=torch.float64)
LABELS = torch.tensor([[2, IGNORE_INDEX]])
P = (1 / 8, 2 / 8, 5 / 8)  # softmax of the first position


def test_label_smoothing_is_one_minus_eps_nll_plus_eps_the_vocabulary_mean_of_minus_log_p() -> None:
    """eps = 0.1 at p = (1/8, 2/8, 5/8), label 2: 0.9 * -log(5/8) + 0.1 * mean(-log 1/8, -log 2/8, -log 5/8)."""
    expected = 0.9 * -math.log(5 / 8) + 0.1 * sum(-math.log(p) for p in P) / 3
    got = tl.smoothed_losses(LOGITS, LABELS, 0.1)
    assert expected == pytest.approx(float(got[0, 0]), rel=1e-12)
    assert 0.0 == float(got[0, 1])


def test_label_smoothing_equals_torch_s_own_on_one_device() -> None:
    """The same numbers as ``F.cross_entropy(..., label_smoothing=eps, reduction="none")`` where it runs."""
    torch_says = torch.nn.functional.cross_entropy(LOGITS[0], LABELS[0], ignore_index=IGNORE_INDEX,
                                                   label_smoothing=0.1, reduction="none")
    torch.testing.assert_close(tl.smoothed_losses(LOGITS, LABELS, 0.1)[0], torch_says, rtol=1e-12, atol=1e-12)


def test_the_entropy_is_minus_the_sum_of_p_log_p_on_supervised_positions_only() -> None:
    """H(1/8, 2/8, 5/8) by hand at the first position, 0 at the unsupervised one."""
    expected = -sum(p * math.log(p) for p in P)
    got = tl.entropies(LOGITS, LABELS)
    assert expected == pytest.approx(float(got[0, 0]), rel=1e-12)
    assert 0.0 == float(got[0, 1])


def test_the_entropy_bonus_term_is_minus_a_log_p_minus_beta_h() -> None:
    """Advantage -1.5 and beta 0.01: the numerator is -(-1.5) * log(5/8) - 0.01 * H, the bonus not weighed by A."""
    mb = Microbatch(torch.zeros_like(LABELS), LABELS, torch.tensor([[-1.5, 0.0]], dtype=torch.float64))
    objective = ob.Objective(ob.ENTROPY_BONUS, weights=ob.ADVANTAGES, coefficient=0.01)
    expected = 1.5 * math.log(5 / 8) - 0.01 * -sum(p * math.log(p) for p in P)
    assert expected == pytest.approx(float(objective.term(LOGITS, mb)), rel=1e-12)
    assert 1.0 == objective.share([mb])  # normalized like the token mean


def test_every_other_objective_keeps_its_numerator_bit_for_bit() -> None:
    """Objective.term is objective_term(token_losses(...)) itself under the objectives of plain cross-entropy."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 6, generator=g)
    labels = torch.randint(0, 6, (2, 4), generator=g)
    labels[1, 2:] = IGNORE_INDEX
    mb = Microbatch(torch.zeros_like(labels), labels, torch.rand(2, 4, generator=g, dtype=torch.float64))
    for objective in (ob.PLAIN, ob.Objective(ob.SEQUENCE_MEAN),
                      ob.Objective(ob.WEIGHTED_TOKEN_MEAN, weights=ob.WEIGHTS),
                      ob.Objective(ob.FIXED_NORMALIZER, 64.0, ob.ADVANTAGES)):
        old = ob.objective_term(ob.token_losses(logits, labels), mb, objective.name, objective.weights is not None)
        assert torch.equal(old, objective.term(logits, mb))


def test_a_recipe_without_its_coefficient_is_refused_naming_the_attribute() -> None:
    """Under --objective=label_smoothing the recipe must declare label_smoothing; the message names the fix."""
    with pytest.raises(ValueError, match=r"declares no `label_smoothing`: under --objective=label_smoothing .*"
                                         r"label_smoothing = 0\.1"):
        resolve(ob.LABEL_SMOOTHING, "harness.recipes:mesh_token_mean")
    with pytest.raises(ValueError, match=r"no `entropy_coefficient`.*entropy_coefficient = 0\.01"):
        resolve(ob.ENTROPY_BONUS, "harness.recipes:mesh_token_mean")


def test_the_declared_coefficients_resolve_and_the_entropy_bonus_draws_advantages() -> None:
    """The correct recipes' own attributes become the objectives' coefficients; entropy_bonus always has advantages."""
    smoothing = resolve(ob.LABEL_SMOOTHING, "harness.recipes.vocab_parallel:label_smoothed_token_mean")
    assert (ob.LABEL_SMOOTHING, 0.1, None) == (smoothing.name, smoothing.coefficient, smoothing.weights)
    bonus = resolve(ob.ENTROPY_BONUS, "harness.recipes.vocab_parallel:policy_entropy_token_mean")
    assert (0.01, ob.ADVANTAGES) == (bonus.coefficient, bonus.weights)


def test_an_out_of_range_coefficient_is_refused() -> None:
    """eps = 1 (or a string) is no smoothing coefficient."""
    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match=r"label_smoothing=.*: under objective=label_smoothing"):
            ob.Objective(ob.LABEL_SMOOTHING, coefficient=bad)  # type: ignore[arg-type]


def test_loss_parallel_s_log_softmax_is_modelled_with_an_identity_backward() -> None:
    """The model's value is log_softmax's; d log p(y) / dz is the one-hot of y alone (the softmax part dropped),
    where the right gradient is one-hot minus p."""
    z = LOGITS[0, 0].clone().requires_grad_(True)
    value = identity_backward_log_softmax(z)
    torch.testing.assert_close(value, torch.log_softmax(LOGITS[0, 0], -1), rtol=0, atol=1e-15)
    value[2].backward()
    assert [0.0, 0.0, 1.0] == z.grad.tolist()  # type: ignore[union-attr]


def test_the_mistakes_are_modelled_only_where_tp_shards_the_vocabulary() -> None:
    """No tp, nothing to read; at tp=2 label smoothing has both readings and the entropy bonus the log_softmax one."""
    smoothing = ob.Objective(ob.LABEL_SMOOTHING, coefficient=0.1)
    assert [] == mistakes(smoothing, 1)
    assert {"smoothing_over_local_vocabulary", "log_softmax_backward_dropped"} == {n for n, _, _ in
                                                                                 mistakes(smoothing, 2)}
    bonus = ob.Objective(ob.ENTROPY_BONUS, weights=ob.ADVANTAGES, coefficient=0.01)
    assert {"log_softmax_backward_dropped"} == {n for n, _, _ in mistakes(bonus, 2)}
    assert [] == mistakes(ob.PLAIN, 2)
