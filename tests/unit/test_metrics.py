"""Metrics across ranks are combined from counts (seed 004: 100 / 120 = 0.8333), never as a mean of per-rank
accuracies (0.70), which is kept as the negative control."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.testing.hypothesis_profiles import load_profile

load_profile()

from harness.core.metrics import accuracy, combine_counts, mean_of_accuracies  # noqa: E402

SEED_004 = [(90, 100), (10, 20)]


def test_seed_004_accuracy_from_counts_is_0_8333() -> None:
    """Rank 0 right on 90 of 100, rank 1 on 10 of 20: 100 of 120 overall."""
    assert 100 / 120 == combine_counts(SEED_004)
    assert "0.8333" == f"{combine_counts(SEED_004):.4f}"


def test_seed_004_mean_of_per_rank_accuracies_is_0_70() -> None:
    """Negative control: the unweighted mean of 0.9 and 0.5 reports 0.70, which the counts check rejects."""
    assert 0.70 == pytest.approx(mean_of_accuracies(SEED_004))
    assert combine_counts(SEED_004) != pytest.approx(mean_of_accuracies(SEED_004))


def test_a_rank_with_no_example_counts_for_nothing() -> None:
    """A rank with (0, 0) leaves the global accuracy unchanged; the mean of accuracies cannot even be computed."""
    assert 0.9 == combine_counts([(90, 100), (0, 0)])
    with pytest.raises(ValueError, match="total=0"):
        mean_of_accuracies([(90, 100), (0, 0)])


counts = st.integers(0, 1000).flatmap(lambda t: st.tuples(st.integers(0, t), st.just(t)))


@given(st.lists(counts, min_size=1, max_size=8).filter(lambda cs: sum(t for _, t in cs) > 0))
def test_combining_counts_is_the_accuracy_of_the_pooled_examples(per_rank: list[tuple[int, int]]) -> None:
    """For any shards, the combination is the accuracy of all examples pooled on one device."""
    pooled = Fraction(sum(c for c, _ in per_rank), sum(t for _, t in per_rank))
    assert float(pooled) == pytest.approx(combine_counts(per_rank), rel=1e-12)


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=8), st.integers(0, 1000))
def test_the_mean_of_accuracies_is_right_only_for_equal_shards(totals: list[int], correct_seed: int) -> None:
    """With equal shard sizes the two agree; the control is wrong for the reason seed 004 gives, not always."""
    size = totals[0]
    per_rank = [((correct_seed + 7 * r) % (size + 1), size) for r in range(len(totals))]
    assert combine_counts(per_rank) == pytest.approx(mean_of_accuracies(per_rank), rel=1e-12)


@pytest.mark.parametrize(
    ("correct", "total", "names"),
    [(-1, 10, "correct=-1"), (11, 10, "exceeds total=10"), (0, 0, "total=0"), (True, 1, "correct=True")],
    ids=["negative", "more-correct-than-total", "no-example", "bool"],
)
def test_bad_counts_are_refused_with_their_name(correct: int, total: int, names: str) -> None:
    """Each invalid count is named in the error."""
    with pytest.raises(ValueError, match=names):
        accuracy(correct, total)
