"""Every worked arithmetic case of the seeds, through the harness's loss API.

Seed 000 is the main one (12 and 36 tokens, loss sums 12 and 108), seed 001 adds the worked example, the exercise,
unequal microbatches and the three-rank exercise, seed 004 the accuracy-from-counts case. Where a seed is plain
arithmetic the test is plain Python; where a seed's number comes from a loss, it goes through ``harness.loss_sum``,
``harness.supervised_count`` and ``harness.global_token_loss``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

import harness
from harness import IGNORE_INDEX
from harness.core.loss import mean_of_means, token_mean
from harness.core.metrics import combine_counts, mean_of_accuracies
from harness.data.batching import collate
from harness.data.corpus import Row


@dataclass(frozen=True)
class Case:
    """Per-unit (rank or microbatch) loss sums and supervised counts, with the seed's two answers."""

    sums: tuple[float, ...]
    counts: tuple[int, ...]
    global_mean: float
    mean_of_means: float


SEED_CASES = {
    "seed000-12-vs-36-tokens": Case((12.0, 108.0), (12, 36), 2.5, 2.0),
    "seed001-worked-example": Case((4.0, 0.0), (1, 3), 1.0, 2.0),
    "seed001-exercise": Case((6.0, 6.0), (2, 4), 2.0, 2.25),
    "seed001-unequal-microbatches": Case((4.0, 6.0), (1, 3), 2.5, 3.0),
    "seed001-three-ranks": Case((4.0, 5.0, 3.0), (2, 1, 3), 2.0, 8 / 3),
}


@pytest.fixture(params=list(SEED_CASES.values()), ids=list(SEED_CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


def _ddp_average(sums: tuple[float, ...], counts: tuple[int, ...]) -> float:
    """What DDP's gradient averaging does to each rank's ``global_token_loss``: sum, then divide by the world size."""
    world = len(sums)
    n = sum(counts)
    scaled = [float(harness.global_token_loss(torch.tensor(s, dtype=torch.float64), n, world)) for s in sums]
    return sum(scaled) / world


def _logits_with_token_losses(losses: list[float], padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[1, T, 2]`` and labels whose cross-entropy is ``losses[t]`` at each supervised position.

    With logits ``(0, z)`` and target 0 the cross-entropy is ``log(1 + e^z)``, so ``z = log(e^loss - 1)``.
    ``padding`` trailing positions carry ``IGNORE_INDEX`` and large logits that would dominate any sum they entered.
    """
    z = [math.log(math.expm1(loss)) for loss in losses] + [50.0] * padding
    logits = torch.zeros(1, len(z), 2, dtype=torch.float64)
    logits[0, :, 1] = torch.tensor(z, dtype=torch.float64)
    labels = torch.full((1, len(z)), IGNORE_INDEX, dtype=torch.int64)
    labels[0, : len(losses)] = 0
    return logits, labels


# --- seed 000: 12 and 36 tokens --------------------------------------------------------------------------------------


def test_mean_of_rank_means_is_two_on_the_12_and_36_token_ranks() -> None:
    """Averaging the two local means (1 and 3) gives 2.0, the biased answer of seed 000."""
    assert 2.0 == mean_of_means((12.0, 108.0), (12, 36))


def test_global_token_mean_is_two_and_a_half_on_the_12_and_36_token_ranks() -> None:
    """All 48 tokens weighted equally give 120 / 48 = 2.5."""
    assert 2.5 == token_mean((12.0, 108.0), (12, 36))


def test_the_seed_means_refuse_units_without_tokens_or_unpaired() -> None:
    """A unit without tokens has no mean; sums and counts must pair up; a window without tokens has no token mean."""
    for call in (lambda: mean_of_means((0.0, 3.0), (0, 1)), lambda: token_mean((1.0,), (1, 2)),
                 lambda: token_mean((0.0, 0.0), (0, 0))):
        with pytest.raises(ValueError):
            call()


def test_loss_sum_and_supervised_count_reproduce_the_seed_ranks() -> None:
    """A rank with 12 tokens of loss 1 and one with 36 tokens of loss 3 sum to 12 and 108, padding excluded."""
    logits0, labels0 = _logits_with_token_losses([1.0] * 12, padding=5)
    logits1, labels1 = _logits_with_token_losses([3.0] * 36, padding=2)
    got = (
        float(harness.loss_sum(logits0, labels0)),
        harness.supervised_count(labels0),
        float(harness.loss_sum(logits1, labels1)),
        harness.supervised_count(labels1),
    )
    assert pytest.approx((12.0, 12, 108.0, 36), rel=1e-12) == got


@pytest.mark.parametrize(("local_sum", "expected"), [(12.0, 0.5), (108.0, 4.5)], ids=["rank0", "rank1"])
def test_scaled_rank_contribution_is_world_size_times_local_sum_over_global_count(
    local_sum: float, expected: float
) -> None:
    """``global_token_loss`` turns the loss sums 12 and 108 of a 48-token window on 2 ranks into 0.5 and 4.5."""
    got = harness.global_token_loss(torch.tensor(local_sum, dtype=torch.float64), 48, 2)
    assert pytest.approx(expected, rel=1e-15) == float(got)


def test_ddp_average_of_the_scaled_contributions_is_the_global_token_mean() -> None:
    """DDP averages 0.5 and 4.5 over two ranks: the result is the global token mean 2.5, not 2.0."""
    assert pytest.approx(2.5, rel=1e-15) == _ddp_average((12.0, 108.0), (12, 36))


def test_splitting_each_rank_into_two_microbatches_keeps_the_global_mean() -> None:
    """Two microbatches per rank, each scaled by the same global count 48, still average to 2.5."""
    # Loss 1 per token on rank 0 (5 + 7 tokens), 3 per token on rank 1 (16 + 20 tokens).
    windows = [[(5.0, 5), (7.0, 7)], [(48.0, 16), (60.0, 20)]]
    n = sum(count for window in windows for _, count in window)
    per_rank = [
        sum(float(harness.global_token_loss(torch.tensor(s, dtype=torch.float64), n, 2)) for s, _ in window)
        for window in windows
    ]
    assert pytest.approx([0.5, 4.5, 2.5], rel=1e-15) == [*per_rank, sum(per_rank) / 2]


def test_an_extra_division_by_accumulation_halves_the_loss_to_one_and_a_quarter() -> None:
    """Dividing every microbatch's contribution again by accumulation = 2 gives 1.25 instead of 2.5 (seed 000)."""
    windows = [[(5.0, 5), (7.0, 7)], [(48.0, 16), (60.0, 20)]]
    accumulation = 2
    per_rank = [
        sum(float(harness.global_token_loss(torch.tensor(s, dtype=torch.float64), 48, 2)) / accumulation for s, _ in w)
        for w in windows
    ]
    assert pytest.approx(1.25, rel=1e-15) == sum(per_rank) / 2


# --- seed 000: one parameter, squared error --------------------------------------------------------------------------


def _squared_error_sums(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0: 12 targets +1; rank 1: 36 targets -1; squared error summed per rank."""
    rank0 = ((theta - torch.ones(12, dtype=torch.float64)) ** 2).sum()
    rank1 = ((theta + torch.ones(36, dtype=torch.float64)) ** 2).sum()
    return rank0, rank1


def test_both_averages_show_loss_one_at_theta_zero() -> None:
    """At theta = 0 every token's loss is 1, so the mean of means and the global mean both read 1."""
    theta = torch.zeros((), dtype=torch.float64)
    s0, s1 = _squared_error_sums(theta)
    assert (1.0, 1.0) == (float(mean_of_means((s0, s1), (12, 36))), float(token_mean((s0, s1), (12, 36))))


def test_mean_of_means_gradient_is_zero_at_theta_zero() -> None:
    """The mean of rank means cancels -2 against +2: its gradient at theta = 0 is 0, so training would not move."""
    theta = torch.zeros((), dtype=torch.float64, requires_grad=True)
    s0, s1 = _squared_error_sums(theta)
    mean_of_means((s0, s1), (12, 36)).backward()
    assert 0.0 == float(theta.grad)


def test_global_token_mean_gradient_is_one_at_theta_zero() -> None:
    """The global token mean weighs 36 tokens of +2 against 12 of -2: (12 * -2 + 36 * 2) / 48 = 1."""
    theta = torch.zeros((), dtype=torch.float64, requires_grad=True)
    s0, s1 = _squared_error_sums(theta)
    token_mean((s0, s1), (12, 36)).backward()
    assert pytest.approx(1.0, rel=1e-15) == float(theta.grad)


def test_averaged_rank_gradients_of_global_token_loss_give_gradient_one() -> None:
    """Each rank backpropagates ``global_token_loss`` on its own copy; DDP's average of the two gradients is 1."""
    grads = []
    for rank in range(2):
        theta = torch.zeros((), dtype=torch.float64, requires_grad=True)
        local_sum = _squared_error_sums(theta)[rank]
        harness.global_token_loss(local_sum, 12 + 36, 2).backward()
        grads.append(float(theta.grad))
    assert pytest.approx(1.0, rel=1e-15) == sum(grads) / 2


# --- every seed case: global token mean versus mean of means ---------------------------------------------------------


def test_seed_case_global_token_mean_is_total_sum_over_total_count(case: Case) -> None:
    """The seed's desired mean is the sum of every unit's loss over every unit's tokens."""
    assert pytest.approx(case.global_mean, rel=1e-15) == token_mean(case.sums, case.counts)


def test_seed_case_mean_of_means_is_the_seed_s_wrong_answer(case: Case) -> None:
    """Averaging each unit's local mean gives the seed's biased number."""
    assert pytest.approx(case.mean_of_means, rel=1e-15) == mean_of_means(case.sums, case.counts)


def test_seed_case_averaged_global_token_loss_is_the_global_mean(case: Case) -> None:
    """Averaging ``global_token_loss`` over the units, as DDP does, gives the global mean and not the mean of means."""
    got = _ddp_average(case.sums, case.counts)
    assert pytest.approx(case.global_mean, rel=1e-14) == got
    assert got != pytest.approx(case.mean_of_means)


def test_unequal_microbatches_on_one_device_sum_to_two_and_a_half() -> None:
    """On one device (world_size=1) microbatches with 1 and 3 tokens and sums 4 and 6 give 10 / 4 = 2.5, not 3."""
    got = sum(float(harness.global_token_loss(torch.tensor(s), 4, 1)) for s in (4.0, 6.0))
    assert pytest.approx(2.5) == got


def test_three_rank_scaled_local_values_are_two_two_and_a_half_and_one_and_a_half() -> None:
    """Seed 001's three ranks: each local sum times 3/6 gives 2, 2.5 and 1.5, whose average is 2."""
    got = [float(harness.global_token_loss(torch.tensor(s, dtype=torch.float64), 6, 3)) for s in (4.0, 5.0, 3.0)]
    assert pytest.approx([2.0, 2.5, 1.5], rel=1e-15) == got
    assert pytest.approx(2.0, rel=1e-15) == sum(got) / 3


# --- seed 004: accuracy from counts ----------------------------------------------------------------------------------


def test_accuracy_from_summed_counts_is_five_sixths() -> None:
    """Rank 0 right on 90 of 100, rank 1 on 10 of 20: summing the counts gives 100 / 120 = 0.8333."""
    assert pytest.approx(0.8333, abs=5e-5) == combine_counts([(90, 100), (10, 20)])


def test_mean_of_per_rank_accuracies_is_seventy_percent() -> None:
    """Averaging the accuracies 0.9 and 0.5 reports the biased 0.70."""
    assert pytest.approx(0.70) == mean_of_accuracies([(90, 100), (10, 20)])


# --- global_token_loss: invalid input --------------------------------------------------------------------------------


@pytest.mark.parametrize("global_count", [0, -1, -48], ids=["zero", "minus-one", "minus-48"])
def test_global_token_loss_rejects_a_window_without_supervised_tokens(global_count: int) -> None:
    """A global count of zero or below is an error that names global_count, never a division by zero."""
    with pytest.raises(ValueError, match=rf"global_count={global_count}\b"):
        harness.global_token_loss(torch.tensor(1.0), global_count, 2)


@pytest.mark.parametrize("world_size", [0, -1, True, 1.5], ids=["zero", "negative", "bool", "float"])
def test_global_token_loss_rejects_an_invalid_world_size(world_size: object) -> None:
    """world_size must be a positive int (not a bool, not a float); the error names world_size and the value."""
    with pytest.raises(ValueError, match=rf"world_size={world_size!r}"):
        harness.global_token_loss(torch.tensor(1.0), 48, world_size)  # type: ignore[arg-type]


def test_global_token_loss_keeps_the_gradient_of_the_local_sum() -> None:
    """The scaled loss is differentiable: d/dx of ``x * W / N`` is ``W / N``."""
    x = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    harness.global_token_loss(x, 8, 2).backward()
    assert 0.25 == float(x.grad)


# --- zero supervised tokens ------------------------------------------------------------------------------------------


def test_loss_sum_over_zero_supervised_tokens_is_zero_with_zero_gradients() -> None:
    """A microbatch whose labels are all IGNORE_INDEX contributes 0 and a zero (not NaN) gradient."""
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits.requires_grad_(True)
    labels = torch.full((2, 5), IGNORE_INDEX, dtype=torch.int64)
    s = harness.loss_sum(logits, labels)
    s.backward()
    assert (0.0, 0) == (float(s.detach()), harness.supervised_count(labels))
    assert torch.equal(torch.zeros_like(logits), logits.grad)


# --- padding and prompt positions never enter the denominator --------------------------------------------------------

ROWS = (
    Row(id=0, split="train", tokens=(3, 4, 5, 6, 7, 1, 2, 3), prompt_len=3),  # 5 supervised
    Row(id=1, split="train", tokens=(2, 4, 6), prompt_len=0),  # 2 supervised, short: padded
    Row(id=2, split="train", tokens=(5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1), prompt_len=2),  # 9 supervised
    Row(id=3, split="train", tokens=(1, 2, 3, 4, 5), prompt_len=1),  # 4 supervised: a 1-token prompt is no prompt
)


def test_microbatch_supervised_is_the_sum_of_row_supervised() -> None:
    """Padding and prompt positions are not counted: the microbatch's count is the rows' counts summed."""
    mb = collate(ROWS)
    assert (20, 20, 20) == (sum(r.supervised for r in ROWS), mb.supervised, harness.supervised_count(mb.labels))


def test_row_supervised_counts_exclude_the_prompt() -> None:
    """Each hand-made row's count is its length minus max(prompt_len, 1)."""
    assert [5, 2, 9, 4] == [r.supervised for r in ROWS]


def test_loss_sum_is_the_hand_sum_over_supervised_positions_only() -> None:
    """loss_sum equals -log p(tokens[t+1]) summed over positions t whose target lies after the prompt."""
    mb = collate(ROWS)
    width = mb.inputs.shape[1]
    logits = torch.randn(len(ROWS), width, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logp = logits.log_softmax(dim=-1)
    expected = 0.0
    for b, row in enumerate(ROWS):
        for t in range(max(row.prompt_len - 1, 0), len(row.tokens) - 1):
            expected -= float(logp[b, t, row.tokens[t + 1]])
    assert pytest.approx(expected, rel=1e-12) == float(harness.loss_sum(logits, mb.labels))


def test_loss_sum_ignores_logits_at_padding_and_prompt_positions() -> None:
    """Changing the logits wherever the label is IGNORE_INDEX leaves loss_sum unchanged."""
    mb = collate(ROWS)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(len(ROWS), mb.inputs.shape[1], 8, generator=gen, dtype=torch.float64)
    ignored = (mb.labels == IGNORE_INDEX).unsqueeze(-1)
    noisy = torch.where(ignored, logits + 100 * torch.randn(logits.shape, generator=gen, dtype=torch.float64), logits)
    assert float(harness.loss_sum(logits, mb.labels)) == float(harness.loss_sum(noisy, mb.labels))


def test_loss_sum_rejects_mismatched_shapes() -> None:
    """Logits and labels of different [B, T] are an error that shows both shapes."""
    with pytest.raises(ValueError, match=r"\(2, 5, 7\).*\(2, 4\)"):
        harness.loss_sum(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.int64))


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"world{w}")
def test_any_split_of_rows_over_ranks_keeps_the_global_token_mean(world: int) -> None:
    """However rows are dealt to ranks, averaging global_token_loss over ranks gives total sum / total count."""
    gen = torch.Generator().manual_seed(3)
    sums = {
        r.id: float(harness.loss_sum(torch.randn(1, len(r.tokens) - 1, 8, generator=gen), collate([r]).labels))
        for r in ROWS
    }
    rows = list(ROWS)
    random.Random(world).shuffle(rows)
    windows = [rows[i::world] for i in range(world)]
    n = sum(r.supervised for r in ROWS)
    scaled = [
        float(harness.global_token_loss(torch.tensor(sum(sums[r.id] for r in w), dtype=torch.float64), n, world))
        for w in windows
    ]
    assert pytest.approx(sum(sums.values()) / n, rel=1e-12) == sum(scaled) / world
