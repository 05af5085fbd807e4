"""The diagnosis's math: the weight fit recovers the weights a gradient was built from, and the catalog names each
signature from the window's real counts.

The block gradients are the battery model's (float64) on the battery's uneven window at W=2 and W=3; a gradient "as
a recipe computed it" is built from chosen weights and rounded to float32 like a real run's.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.battery import scenarios
from harness.core.compare import flat_grad
from harness.core.loss import loss_sum
from harness.core.microbatch import Microbatch
from harness.diagnosis.factor_names import factor_readings, name_factor
from harness.diagnosis.fit import (
    EXACT_TOLERANCE,
    EXPLAINED_RESIDUAL,
    FLOAT32_RESIDUAL,
    MAX_CONDITION,
    Block,
    Fit,
    fit_weights,
)
from harness.diagnosis.parameter_view import locate, parameter_table, residual_shares
from harness.diagnosis.signatures import Signature, classify, classify_sequences, patterns
from harness.model import build_model


class Window:
    def __init__(self, world: int) -> None:
        self.world = world
        window = scenarios.build("uneven", world)[0]
        model = build_model(scenarios.BATTERY_CONFIG).double()
        self.names = [n for n, _ in model.named_parameters()]
        self.sizes = [p.numel() for p in model.parameters()]
        self.blocks: list[Block] = []
        cols, rows, row_cols = [], [], []
        for r, mbs in enumerate(window):
            for m, mb in enumerate(mbs):
                self.blocks.append(Block(r, m, mb.supervised))
                cols.append(self._grad(model, mb))
                for i in range(mb.inputs.shape[0]):
                    row = Microbatch(mb.inputs[i : i + 1], mb.labels[i : i + 1])
                    rows.append(Block(r, m, row.supervised, row=i))
                    row_cols.append(self._grad(model, row))
        self.columns = torch.stack(cols, dim=1)
        self.rows, self.row_columns = rows, torch.stack(row_cols, dim=1)
        self.n = sum(b.tokens for b in self.blocks)

    @staticmethod
    def _grad(model: torch.nn.Module, mb: Microbatch) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss_sum(model(mb.inputs), mb.labels).backward()
        return flat_grad(model)

    def gradient(self, ratios: list[float], fp32: bool = True) -> torch.Tensor:
        """``sum_b ratio_b / N * G_b``, rounded to float32 unless ``fp32`` is False."""
        g = self.columns @ (torch.tensor(ratios, dtype=torch.float64) / self.n)
        return g.float().double() if fp32 else g

    def classify(self, ratios: list[float], precision: str = "fp32", rank: int = 0) -> Signature:
        g = self.gradient(ratios, fp32=precision == "fp32")
        return classify(self.blocks, fit_weights(self.columns, g), self.world, precision, rank=rank)


@functools.cache
def window(world: int) -> Window:
    """The uneven window at ``world`` ranks, computed once per process."""
    return Window(world)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def win(request: pytest.FixtureRequest) -> Window:
    return window(request.param)


def test_the_right_weights_are_recovered_within_1e_5_from_a_float32_gradient(win: Window) -> None:
    """The bound the catalog calls right in float32 (EXACT_TOLERANCE), on a gradient rounded to float32."""
    fit = fit_weights(win.columns, win.gradient([1.0] * len(win.blocks)))
    assert max(abs(float(w) * win.n - 1) for w in fit.weights) <= EXACT_TOLERANCE["fp32"]
    assert fit.residual < 1e-6
    assert fit.condition < 10
    assert "correct" == win.classify([1.0] * len(win.blocks)).name


def test_a_weighting_off_by_a_tenth_of_a_percent_is_not_called_right(win: Window) -> None:
    """The negative control of the one above: 1.001 everywhere is a scale, not the global token mean."""
    sig = win.classify([1.001] * len(win.blocks))
    assert "global_scale" == sig.name
    assert sig.factor == pytest.approx(1.001, rel=1e-5)


@pytest.mark.parametrize("name", ["mean_of_local_means", "per_microbatch_mean"])
def test_each_rank_level_pattern_is_named_from_the_real_counts(win: Window, name: str) -> None:
    pattern = patterns(win.blocks, win.world)[name]
    sig = win.classify(pattern)
    assert name == sig.name
    assert sig.factor == pytest.approx(1.0, rel=1e-4)


def test_a_pattern_times_a_factor_names_both(win: Window) -> None:
    """A mean of local means under a summing reduction: the pattern, then 'W times too large'."""
    pattern = patterns(win.blocks, win.world)["mean_of_local_means"]
    sig = win.classify([win.world * p for p in pattern])
    assert "mean_of_local_means" == sig.name
    assert "applied twice" in sig.sentence


def test_global_scales_are_named_by_their_factor(win: Window) -> None:
    k = len(win.blocks) // win.world
    assert "world-size factor is missing" in win.classify([1 / win.world] * len(win.blocks)).sentence
    assert "applied twice" in win.classify([float(win.world)] * len(win.blocks)).sentence
    assert f"microbatch count k={k}" in win.classify([1 / k] * len(win.blocks)).sentence
    odd = win.classify([0.8] * len(win.blocks)).sentence
    assert "no token count of this window" in odd and "normalized by" not in odd


def test_a_count_from_another_window_is_named() -> None:
    blocks = [Block(0, 0, 30), Block(1, 0, 50)]
    words = name_factor(80 / 100, blocks, 2, {"window 0's global count": 100})
    assert "window 0's global count (100 tokens)" in words


def test_a_dropped_microbatch_is_named(win: Window) -> None:
    ratios = [0.0 if (b.rank, b.microbatch) == (1, 1) else 1.0 for b in win.blocks]
    sig = win.classify(ratios)
    assert "dropped" == sig.name
    assert ("rank 1's microbatch 1",) == sig.blocks


def test_a_double_counted_microbatch_is_named(win: Window) -> None:
    ratios = [2.0 if (b.rank, b.microbatch) == (0, 0) else 1.0 for b in win.blocks]
    sig = win.classify(ratios)
    assert "double_counted" == sig.name
    assert ("rank 0's microbatch 0",) == sig.blocks


def test_a_gradient_that_never_left_its_rank_is_named(win: Window) -> None:
    ratios = [float(win.world) if b.rank == 0 else 0.0 for b in win.blocks]
    assert "not_synchronized" == win.classify(ratios, rank=0).name
    # The same weights read as another rank's gradient are not that rank's own: they are just dropped blocks.
    assert "dropped" == win.classify(ratios, rank=1).name


def test_float32_rounding_in_a_float64_run_is_told_from_a_right_float64_gradient(win: Window) -> None:
    ones = [1.0] * len(win.blocks)
    assert "correct" == win.classify(ones, precision="fp64").name
    g = win.gradient(ones, fp32=True)  # float32-rounded, read as a float64 run's gradient
    fit = fit_weights(win.columns, g)
    assert "float32_computation" == classify(win.blocks, fit, win.world, "fp64").name


def test_one_scaled_parameter_is_not_a_reweighting_and_the_table_names_it(win: Window) -> None:
    g = win.gradient([1.0] * len(win.blocks))
    target = win.names.index("blocks.0.mlp.2.weight")
    start = sum(win.sizes[:target])
    g[start : start + win.sizes[target]] *= 2
    fit = fit_weights(win.columns, g)
    assert fit.residual > EXPLAINED_RESIDUAL
    assert "unexplained" == classify(win.blocks, fit, win.world, "fp32").name
    expected = win.columns.sum(dim=1) / win.n
    rows = parameter_table(g, expected, win.names, win.sizes, 1e-6, 1e-4)
    off = [r for r in rows if r.over_tolerance]
    assert ["blocks.0.mlp.2.weight"] == [r.name for r in off]
    assert off[0].ratio == pytest.approx(2.0, rel=1e-4)
    assert locate(rows).startswith("1 of 18 parameter tensors are off: blocks.0.mlp.2.weight (ratio 2")


def test_a_uniform_ratio_over_every_tensor_is_located_as_a_scale(win: Window) -> None:
    g = win.gradient([1.0] * len(win.blocks)) * 1.5
    rows = parameter_table(g, win.columns.sum(dim=1) / win.n, win.names, win.sizes, 1e-6, 1e-4)
    assert "the same ratio 1.5" in locate(rows)


def test_float32_noise_over_every_tensor_is_not_called_a_scale(win: Window) -> None:
    """Every tensor at ratio 1 but over float64's tolerances: noise, a lower precision, never "a scale on the whole
    gradient"; its negative control, a real 1.5 scale, is the test above."""
    g = win.gradient([1.0] * len(win.blocks), fp32=True)
    rows = parameter_table(g, win.columns.sum(dim=1) / win.n, win.names, win.sizes, 1e-12, 1e-9)
    words = locate(rows)
    assert "noise spread over every component" in words and "scale on the whole gradient" not in words


def test_a_mean_per_sequence_is_found_by_the_per_row_fit(win: Window) -> None:
    weights = torch.tensor([1.0 / b.tokens / len(win.rows) if b.tokens else 0.0 for b in win.rows],
                           dtype=torch.float64)
    g = (win.row_columns @ weights).float().double()
    micro = fit_weights(win.columns, g)
    assert "unexplained" == classify(win.blocks, micro, win.world, "fp32").name
    seq = classify_sequences(win.rows, fit_weights(win.row_columns, g))
    assert seq is not None and "per_sequence_mean" == seq.name
    # Per-token weights are not a mean per sequence.
    right = (win.row_columns.sum(dim=1) / win.n).float().double()
    assert classify_sequences(win.rows, fit_weights(win.row_columns, right)) is None


@settings(deadline=None)  # a least-squares solve per example: timing varies on a shared machine
@given(st.data())
def test_drawn_weight_patterns_are_recovered(win: Window, data: st.DataObject) -> None:
    ratios = data.draw(st.lists(st.floats(0.2, 5.0), min_size=len(win.blocks), max_size=len(win.blocks)))
    fit = fit_weights(win.columns, win.gradient(ratios))
    got = [float(w) * win.n for w in fit.weights]
    for want, have in zip(ratios, got):
        assert have == pytest.approx(want, rel=1e-5)
    assert fit.residual < 1e-6


def test_a_block_without_a_token_gets_no_weight() -> None:
    cols = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    fit = fit_weights(cols, torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64))
    assert 0.5 == pytest.approx(float(fit.weights[0]))
    assert math.isnan(float(fit.weights[1]))
    assert fit.residual < 1e-12


def test_shapes_that_do_not_match_are_refused_with_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"columns \(3, 2\) and g \(4,\)"):
        fit_weights(torch.zeros(3, 2), torch.zeros(4))


def test_blocks_too_alike_to_weigh_apart_are_not_given_a_signature() -> None:
    """Two blocks with the same gradient: any split of their weight fits, so no reading of the weights is offered."""
    col = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    fit = fit_weights(torch.stack([col, col], dim=1), col * 0.5)
    assert fit.condition > MAX_CONDITION
    blocks = [Block(0, 0, 10), Block(1, 0, 10)]
    sig = classify(blocks, fit, 2, "fp32", rank=0)
    assert "unexplained" == sig.name and "too alike" in sig.sentence


def test_a_scale_that_only_comes_near_a_named_factor_is_not_named_after_it() -> None:
    """0.49985 (3e-4 off half) is not "1/W" or "1/k", nor any other fact of the window; 0.5 to float32 rounding
    is 1/W."""
    blocks = [Block(0, 0, 120), Block(0, 1, 130), Block(1, 0, 400), Block(1, 1, 597)]
    assert "world-size factor is missing" in name_factor(0.5 * (1 + 1e-7), blocks, 2)
    near = name_factor(0.5 * (1 - 3e-4), blocks, 2)
    assert "no token count of this window" in near and "missing" not in near and "microbatch count" not in near


# --- The sentences of issue 18: each cause named from the real counts, with its negative control -----------------


def _k(win: Window) -> int:
    return len(win.blocks) // win.world


def test_the_world_size_applied_twice_is_named_in_both_directions(win: Window) -> None:
    w = win.world
    down = win.classify([1 / w**2] * len(win.blocks))
    assert "global_scale" == down.name and down.sentence.startswith("the loss divided by W twice"), down.sentence
    up = win.classify([float(w**2)] * len(win.blocks))
    assert up.sentence.startswith("the loss multiplied by W twice"), up.sentence


def test_the_world_size_twice_is_not_read_at_one_rank() -> None:
    """W=1: W^2 = W = 1, so no world-size reading exists; 1/4 is no world-size factor there."""
    blocks = [Block(0, 0, 120, rows=2), Block(0, 1, 130, rows=2)]
    words = name_factor(0.25, blocks, 1)
    assert "W twice" not in words and "world-size" not in words


def test_a_world_size_factor_written_for_two_ranks_is_named_at_three() -> None:
    win = window(3)
    sig = win.classify([2 / 3] * len(win.blocks))
    assert "a world-size factor written for W=2" in sig.sentence, sig.sentence
    # Its negative control: at W=2 the same 2/3 is no world-size factor written for two ranks.
    assert not any("written for W=2" in w for w in factor_readings(2 / 3, win.blocks, 2))


def test_a_count_averaged_over_the_ranks_then_doubled_is_named_away_from_two() -> None:
    """``2 * N / W`` for the count: every weight W/2 (1.5 at W=3, 2 at W=4, where it is also k=2's reading)."""
    win = window(3)
    sig = win.classify([1.5] * len(win.blocks))
    assert "global_scale" == sig.name and "a count averaged over the ranks" in sig.sentence, sig.sentence
    words = factor_readings(2.0, window(4).blocks, 4)
    assert any("a count averaged over the ranks" in w and "here W=4" in w for w in words), words
    # Its negative control: at W=2 the same 1.5 is no count averaged and doubled (W/2 is 1 there).
    assert not any("averaged" in w for w in factor_readings(1.5, win.blocks, 2))


def test_a_count_over_a_subgroup_of_ranks_is_named_with_its_groups() -> None:
    """W=4 over two nodes of two: node g's tokens weigh N / N_g (its count all-reduced over the node-local ranks)."""
    win = window(4)
    per_rank = {r: sum(b.tokens for b in win.blocks if b.rank == r) for r in range(4)}
    node = {r: per_rank[r // 2 * 2] + per_rank[r // 2 * 2 + 1] for r in range(4)}
    sig = win.classify([win.n / node[b.rank] for b in win.blocks])
    assert "subgroup_count" == sig.name, sig.sentence
    assert "LOCAL_WORLD_SIZE=2" in sig.sentence and f"ranks 0-1's tokens ({node[0]} of N={win.n})" in sig.sentence
    # Its negative controls: each rank's own count (a group of one) is the mean of local means, scaled by W; and
    # groups that are not consecutive ranks (0 and 2, 1 and 3) are no node.
    local = win.classify([win.n / per_rank[b.rank] for b in win.blocks])
    assert "mean_of_local_means" == local.name, local.sentence
    strided = {r: per_rank[r % 2] + per_rank[r % 2 + 2] for r in range(4)}
    assert "subgroup_count" != win.classify([win.n / strided[b.rank] for b in win.blocks]).name


def test_a_missing_division_by_k_is_named_so_not_undone_twice(win: Window) -> None:
    k = _k(win)
    words = win.classify([float(k)] * len(win.blocks)).sentence
    assert f"the division by the microbatch count k={k} is missing" in words and "undone" not in words


def test_no_microbatch_reading_is_offered_where_k_is_one() -> None:
    """k=1: dividing by k does nothing, so neither "an extra division by k=1" nor the 1/(k*W) entry is offered; the
    negative control at k=2 names the division."""
    one = [Block(0, 0, 150, rows=2), Block(1, 0, 400, rows=3)]
    words = factor_readings(0.5, one, 2)
    assert not any("microbatch count" in w for w in words), words
    two = [Block(r, m, t, rows=2) for r, m, t in [(0, 0, 70), (0, 1, 80), (1, 0, 200), (1, 1, 210)]]
    assert any("extra division by the microbatch count k=2" in w for w in factor_readings(0.5, two, 2))


def test_a_fixed_accumulation_constant_is_named_with_its_value() -> None:
    """Each microbatch's mean divided by K=4 on a window of k=5: the per-microbatch pattern times k/K."""
    blocks = [Block(r, m, t, rows=2) for r, row in enumerate([[72, 56, 81, 43, 69], [246, 167, 210, 175, 185]])
              for m, t in enumerate(row)]
    pattern = patterns(blocks, 2)["per_microbatch_mean"]
    fit = Fit(torch.tensor([p * 5 / 4 / sum(b.tokens for b in blocks) for p in pattern], dtype=torch.float64),
                 0.0, 1.0)
    sig = classify(blocks, fit, 2, "fp32", rank=0)
    assert "fixed_accumulation_constant" == sig.name
    assert "fixed accumulation constant K=4 where the window has k=5 microbatches" in sig.sentence
    # The negative control: K = k (the mean per microbatch divided by its own k) is the plain per-microbatch mean.
    plain = Fit(torch.tensor([p / sum(b.tokens for b in blocks) for p in pattern], dtype=torch.float64), 0.0, 1.0)
    assert "per_microbatch_mean" == classify(blocks, plain, 2, "fp32", rank=0).name


def test_a_count_is_named_only_when_it_is_a_count_of_the_window(win: Window) -> None:
    """A rank's count, a microbatch's, W times the largest rank's, N plus one token per row: named; 1.001 is none."""
    n, w = win.n, win.world
    ranks: dict[int, int] = {}
    for b in win.blocks:
        ranks[b.rank] = ranks.get(b.rank, 0) + b.tokens
    blocks = [Block(b.rank, b.microbatch, b.tokens, rows=2) for b in win.blocks]
    rows = 2 * len(blocks)
    assert "rank 1's local count" in name_factor(n / ranks[1], blocks, w)
    assert "W times the largest rank's count" in name_factor(n / (w * max(ranks.values())), blocks, w)
    assert "N plus one token per row" in name_factor(n / (n + rows), blocks, w)
    assert "N minus one token per row" in name_factor(n / (n - rows), blocks, w)
    assert f"{blocks[0].label()}'s own count" in name_factor(n / blocks[0].tokens, blocks, w)
    odd = name_factor(1.001, blocks, w)
    assert "no token count of this window" in odd and "normalized by" not in odd


def test_a_pure_scale_on_a_window_with_one_empty_rank_is_read_as_the_scale_first() -> None:
    """One rank holds every token: a mean of local means and 1/k give the same weights; the scale leads."""
    blocks = [Block(0, 0, 0, rows=2), Block(0, 1, 0, rows=2), Block(1, 0, 300, rows=2),
              Block(1, 1, 310, rows=2)]
    fit = Fit(torch.tensor([math.nan, math.nan, 0.5 / 610, 0.5 / 610], dtype=torch.float64), 0.0, 1.0)
    sig = classify(blocks, fit, 2, "fp32", rank=1)
    assert "global_scale" == sig.name and "mean_of_local_means" in sig.alternatives, sig


def test_one_microbatch_index_off_by_its_ranks_local_count_is_block_scaled(win: Window) -> None:
    """Microbatch 0 of every rank normalized by its rank's local count, every other block right."""
    ranks: dict[int, int] = {}
    for b in win.blocks:
        ranks[b.rank] = ranks.get(b.rank, 0) + b.tokens
    ratios = [win.n / ranks[b.rank] if b.microbatch == 0 else 1.0 for b in win.blocks]
    sig = win.classify(ratios)
    assert "block_scaled" == sig.name, sig.sentence
    assert "rank 1's microbatch 0 weighs" in sig.sentence and "rank 1's local count" in sig.sentence
    assert "every other block right" in sig.sentence


def test_one_block_off_by_an_odd_factor_is_block_scaled_without_a_count(win: Window) -> None:
    ratios = [0.71 if (b.rank, b.microbatch) == (1, 0) else 1.0 for b in win.blocks]
    sig = win.classify(ratios)
    assert "block_scaled" == sig.name and sig.sentence.startswith("rank 1's microbatch 0 weighs 0.71x")
    assert "normalized by" not in sig.sentence
    # The negative control: blocks spread over several ranks and indices are no block-wise reading.
    spread = [0.71 if (b.rank, b.microbatch) in ((0, 0), (1, 1)) else 1.0 for b in win.blocks]
    assert "block_scaled" != win.classify(spread).name


def test_right_weights_with_an_extra_term_are_not_called_right_or_float32(win: Window) -> None:
    """A small extra term (an L2 penalty's gradient on one tensor) over a float64 gradient: its residual, far above
    float32 rounding, reads extra_term, never correct or float32_computation; float32 rounding alone (the negative
    control) still reads float32_computation."""
    g = win.gradient([1.0] * len(win.blocks), fp32=False)
    target = win.names.index("blocks.0.mlp.2.weight")
    start = sum(win.sizes[:target])
    extra = torch.zeros_like(g)
    extra[start : start + win.sizes[target]] = torch.linspace(-1, 1, win.sizes[target], dtype=torch.float64)
    g = g + extra * (2e-5 * float(g.norm()) / float(extra.norm()))
    fit = fit_weights(win.columns, g)
    assert FLOAT32_RESIDUAL < fit.residual <= EXPLAINED_RESIDUAL
    sig = classify(win.blocks, fit, win.world, "fp64")
    assert "extra_term" == sig.name, sig.sentence
    assert "rounding bound 1e-10" in sig.sentence
    rounded = fit_weights(win.columns, win.gradient([1.0] * len(win.blocks), fp32=True))
    assert rounded.residual <= FLOAT32_RESIDUAL
    assert "float32_computation" == classify(win.blocks, rounded, win.world, "fp64").name


def test_the_residual_shares_name_the_tensor_that_carries_it(win: Window) -> None:
    names, sizes = win.names, win.sizes
    resid = torch.zeros(sum(sizes), dtype=torch.float64)
    i = names.index("head.bias")
    resid[sum(sizes[:i]) : sum(sizes[: i + 1])] = 1.0
    shares = dict(residual_shares(resid, names, sizes))
    assert 1.0 == shares["head.bias"] and 0.0 == shares["tok.weight"]


def test_a_tensor_without_a_gradient_reads_no_gradient(win: Window) -> None:
    """Zero where the reference is not: "no gradient"; zero where it is zero too: "none expected"; never "max abs
    err 0, ratio 1" for the second, and a live tensor (the negative control) keeps its ratio."""
    expected = win.columns.sum(dim=1) / win.n
    g = expected.clone()
    i = win.names.index("head.weight")
    g[sum(win.sizes[:i]) : sum(win.sizes[: i + 1])] = 0
    j = win.names.index("head.bias")
    expected[sum(win.sizes[:j]) : sum(win.sizes[: j + 1])] = 0
    g[sum(win.sizes[:j]) : sum(win.sizes[: j + 1])] = 0
    rows = {r.name: r for r in parameter_table(g, expected, win.names, win.sizes, 1e-6, 1e-4)}
    assert "no gradient" == rows["head.weight"].note
    assert "no gradient (none expected)" == rows["head.bias"].note
    assert "" == rows["tok.weight"].note and rows["tok.weight"].ratio == pytest.approx(1.0)
    assert "head.weight (no gradient," in locate(list(rows.values()))
