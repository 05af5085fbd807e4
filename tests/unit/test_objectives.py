"""The declared objectives as plain arithmetic: the worked example, the per-token coefficients and normalizers of a
microbatch, the factors the harness draws, and the one rule that keeps each objective right however the window is
split across ranks and microbatches (``harness.core.objectives``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.battery.plan import options
from harness.battery.prepare.objective import resolve
from harness.core import objectives as ob
from harness.core.microbatch import IGNORE_INDEX, Microbatch

# The worked example of docs/objectives.md: rank 0 holds three sequences of 4 tokens of loss 1, rank 1 three of 12
# tokens of loss 3.
SHORT = [[1.0] * 4 for _ in range(3)]
LONG = [[3.0] * 12 for _ in range(3)]


def test_the_worked_example_gives_the_token_mean_and_the_sequence_mean_their_own_values() -> None:
    """(12 + 108) / 48 = 2.5 per token; (1 + 1 + 1 + 3 + 3 + 3) / 6 = 2 per sequence."""
    assert 2.5 == ob.objective_value(ob.TOKEN_MEAN, [SHORT, LONG])
    assert 2.0 == ob.objective_value(ob.SEQUENCE_MEAN, [SHORT, LONG])


def test_the_worked_example_under_weights_and_a_fixed_normalizer() -> None:
    """Weights 2 on the short rank's tokens, 1 on the long one's: (24 + 108) / (24 + 36); a constant 64: 120 / 64."""
    weighted = [[[(loss, 2.0) for loss in seq] for seq in SHORT], [[(loss, 1.0) for loss in seq] for seq in LONG]]
    assert 132 / 60 == ob.objective_value(ob.WEIGHTED_TOKEN_MEAN, weighted)  # type: ignore[arg-type]
    assert 120 / 64 == ob.objective_value(ob.FIXED_NORMALIZER, [SHORT, LONG], normalizer=64)


def test_an_objective_over_nothing_is_refused() -> None:
    """No supervised token (or every weight 0) is no mean at all, and a fixed normalizer needs its constant."""
    with pytest.raises(ValueError, match="normalizer is 0"):
        ob.objective_value(ob.WEIGHTED_TOKEN_MEAN, [[[(1.0, 0.0)]]])
    with pytest.raises(ValueError, match="normalizer=None"):
        ob.objective_value(ob.FIXED_NORMALIZER, [SHORT])


def _mb(rows: list[tuple[int, int]], weights: list[list[float]] | None = None) -> Microbatch:
    """Rows of ``(length, supervised)`` positions: the first ``length - supervised`` masked as a prompt."""
    t = max(n for n, _ in rows)
    labels = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.int64)
    for i, (n, s) in enumerate(rows):
        labels[i, n - s : n] = 1
    w = None if weights is None else torch.tensor(weights, dtype=torch.float64)
    return Microbatch(torch.ones_like(labels), labels, w)


def test_a_microbatch_gives_each_objective_its_coefficients_and_its_share_of_the_normalizer() -> None:
    """Rows of 3 and 1 supervised tokens (one row with none): the sequence mean gives 1/3 and 1 and counts 2 rows."""
    mb = _mb([(4, 3), (4, 1), (4, 0)])
    assert 4.0 == ob.share(ob.TOKEN_MEAN, mb)
    assert 2.0 == ob.share(ob.SEQUENCE_MEAN, mb)
    assert 0.0 == ob.share(ob.FIXED_NORMALIZER, mb)
    c = ob.coefficients(ob.SEQUENCE_MEAN, mb)
    assert [0, 1 / 3, 1 / 3, 1 / 3] == pytest.approx(c[0].tolist())
    assert [0, 0, 0, 1] == c[1].tolist() and [0, 0, 0, 0] == c[2].tolist()
    assert 4.0 == float(ob.coefficients(ob.TOKEN_MEAN, mb).sum())


def test_weights_enter_the_numerator_and_only_the_weighted_mean_divides_by_their_sum() -> None:
    """The batch's weights scale each token under every objective; the plain reading ignores them."""
    mb = _mb([(2, 2)], [[0.5, 2.0]])
    assert [0.5, 2.0] == ob.coefficients(ob.TOKEN_MEAN, mb)[0].tolist()
    assert [1.0, 1.0] == ob.coefficients(ob.TOKEN_MEAN, mb, weighted=False)[0].tolist()
    assert 2.5 == ob.share(ob.WEIGHTED_TOKEN_MEAN, mb) and 2.0 == ob.share(ob.TOKEN_MEAN, mb)


def test_drawn_weights_include_zeros_stay_on_supervised_tokens_and_repeat() -> None:
    """The draw is deterministic, non-negative with zeros, exact in float32, and zero off the supervised tokens."""
    windows = [[[_mb([(9, 6), (9, 9), (9, 3)]) for _ in range(3)] for _ in range(2)]]
    a, b = ob.with_factors(windows, ob.WEIGHTS), ob.with_factors(windows, ob.WEIGHTS)
    w = torch.cat([mb.weights.flatten() for rank in a[0] for mb in rank])  # type: ignore[union-attr]
    assert torch.equal(w, torch.cat([mb.weights.flatten() for rank in b[0] for mb in rank]))  # type: ignore[union-attr]
    assert bool((w == 0).any()) and bool((w >= 0).all()) and bool((w > 0).any())
    assert torch.equal(w, w.float().double())
    mask = torch.cat([(mb.labels != IGNORE_INDEX).flatten() for rank in a[0] for mb in rank])
    assert float(w[~mask].abs().sum()) == 0
    adv = torch.cat([mb.weights.flatten() for rank in ob.with_factors(windows, ob.ADVANTAGES)[0]  # type: ignore[union-attr]
                     for mb in rank])
    assert bool((adv < 0).any()) and bool((adv > 0).any())


def test_a_window_whose_draw_weighs_nothing_gets_one_weighted_token() -> None:
    """A zero weight sum over supervised tokens is the empty window's case: the draw keeps one token's weight."""
    windows = [[[_mb([(2, 1)], [[0.0, 0.0]])]]]
    drawn = ob.with_factors(windows, ob.WEIGHTS)
    assert 1.0 == ob.share(ob.WEIGHTED_TOKEN_MEAN, drawn[0][0][0])


@st.composite
def _split(draw: st.DrawFn) -> tuple[list[list[list[list[tuple[float, float]]]]], int]:
    """Sequences of (loss, weight) tokens dealt to W ranks and k microbatches each, with empty sequences."""
    world, k = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    token = st.tuples(st.integers(0, 40).map(lambda x: x / 8), st.integers(0, 8).map(lambda x: x / 4))
    seqs = st.lists(st.lists(token, max_size=5), min_size=1, max_size=3)
    return [[draw(seqs) for _ in range(k)] for _ in range(world)], world


@settings(max_examples=60, deadline=None)
@given(split=_split(), name=st.sampled_from([ob.TOKEN_MEAN, ob.SEQUENCE_MEAN, ob.WEIGHTED_TOKEN_MEAN]))
def test_each_rank_backpropagating_w_times_its_terms_over_the_global_normalizer_averages_to_the_objective(
        split: tuple[list[list[list[list[tuple[float, float]]]]], int], name: str) -> None:
    """However the window is split, the mean over ranks of ``W * (local terms) / Z`` is the global objective: the rule
    that stays right across ranks and microbatches, and only because Z is the all-reduced one."""
    window, world = split
    flat = [[seq for mb in rank for seq in mb] for rank in window]
    z = 0.0
    for rank in flat:
        for seq in rank:
            if seq:
                unit = {ob.TOKEN_MEAN: len(seq), ob.SEQUENCE_MEAN: 1, ob.WEIGHTED_TOKEN_MEAN: sum(w for _, w in seq)}
                z += unit[name]
    if z == 0:
        with pytest.raises(ValueError):
            ob.objective_value(name, flat)
        return
    per_rank = []
    for rank in window:
        local = 0.0
        for mb in rank:  # one microbatch at a time, as accumulation does
            for seq in mb:
                c = 1 / len(seq) if name == ob.SEQUENCE_MEAN and seq else 1.0
                local += sum(c * w * loss for loss, w in seq)
        per_rank.append(world * local / z)
    assert sum(per_rank) / world == pytest.approx(ob.objective_value(name, flat), rel=1e-12, abs=1e-12)


def test_the_options_and_the_core_name_the_same_objectives() -> None:
    """The pure-Python options list the core's objectives, the default first, and refuse another with one message."""
    assert options.OBJECTIVES == ob.OBJECTIVES and "token_mean" == ob.OBJECTIVES[0]
    with pytest.raises(ValueError) as core:
        ob.check_objective("mean")
    with pytest.raises(ValueError) as opt:
        options.check_objective("mean")
    assert str(core.value) == str(opt.value)


@pytest.mark.parametrize(("fields", "says"), [
    ({"name": "fixed_normalizer"}, "normalizer=None: under objective=fixed_normalizer the recipe declares"),
    ({"name": "fixed_normalizer", "normalizer": -1.0}, "normalizer=-1.0"),
    ({"weights": "ranks"}, "token_weights='ranks' must be one of weights, advantages"),
    ({"name": "weighted_token_mean", "weights": "advantages"}, "advantages are signed"),
    ({"auxiliary_unit": "window"}, "auxiliary_unit='window' must be one of microbatch, token"),
])
def test_a_bad_objective_declaration_is_refused_naming_it(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        ob.Objective(**fields)  # type: ignore[arg-type]


def test_a_recipe_judged_under_a_fixed_normalizer_must_declare_its_constant() -> None:
    """The correct token-mean recipe declares no normalizer: the error names the attribute and how to set it."""
    with pytest.raises(ValueError, match=r"declares no `normalizer`.*normalizer = 1024.0"):
        resolve("fixed_normalizer", "harness.recipes:global_token_mean")
    assert 1024.0 == resolve("fixed_normalizer", "harness.recipes.objectives:fixed_normalizer").normalizer


def test_a_recipe_declares_advantages_and_its_auxiliary_term_through_the_contract() -> None:
    """What the harness reads off a recipe: the factors to draw and the auxiliary term's unit."""
    pg = resolve("sequence_mean", "harness.recipes.objectives:pg_sequence_mean")
    assert ob.ADVANTAGES == pg.weights and pg.auxiliary_unit is None
    assert ob.WEIGHTS == resolve("weighted_token_mean", "harness.recipes:global_token_mean").weights
    aux = resolve("token_mean", "harness.recipes.objectives:token_mean_with_load_balance")
    assert ob.MICROBATCH == aux.auxiliary_unit and not aux.plain
    assert resolve("token_mean", "harness.recipes:global_token_mean").plain


def test_a_part_of_a_row_divides_by_its_whole_rows_count_under_the_sequence_mean() -> None:
    """``Microbatch.counts``: a cp chunk's block carries each row's whole count, and the sequence mean's coefficient
    divides by it (1/5 for a row of 5 tokens of which the chunk holds 2), not by the chunk's own count (1/2, its
    control); a count of another shape is refused."""
    coefficients = ob.coefficients
    labels = torch.tensor([[3, 4, -100, -100]])
    part = Microbatch(torch.ones(1, 4, dtype=torch.int64), labels)
    assert torch.allclose(coefficients("sequence_mean", part)[0, :2], torch.full((2,), 0.5, dtype=torch.float64))
    whole = Microbatch(part.inputs, labels, counts=torch.tensor([5]))
    assert torch.allclose(coefficients("sequence_mean", whole)[0, :2], torch.full((2,), 0.2, dtype=torch.float64))
    assert torch.equal(whole.row(0).counts, torch.tensor([5]))
    assert torch.allclose(coefficients("token_mean", whole), coefficients("token_mean", part))
    with pytest.raises(TypeError, match="counts must be None or an int64 tensor"):
        Microbatch(part.inputs, labels, counts=torch.tensor([5, 6]))
