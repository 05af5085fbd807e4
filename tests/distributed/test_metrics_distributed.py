"""Metrics across real ranks from all-reduced counts on the count device; the all-reduced mean of per-rank
accuracies is the negative control (seed 004: 0.8333 vs 0.70)."""

from __future__ import annotations

import pytest
from support.metrics_bodies import metrics_rank_body

from harness.distributed.launcher import launch


def test_seed_004_accuracy_from_all_reduced_counts_is_0_8333_on_every_rank() -> None:
    """Two ranks with 90/100 and 10/20: every rank reports 100/120 from the all-reduced counts."""
    results = launch(metrics_rank_body, 2, [(90, 100), (10, 20)])
    assert [100 / 120] * 2 == [r["from_counts"] for r in results]


def test_seed_004_mean_of_all_reduced_accuracies_is_0_70() -> None:
    """Negative control: all-reducing the per-rank accuracies and dividing by W reports 0.70 on every rank."""
    results = launch(metrics_rank_body, 2, [(90, 100), (10, 20)])
    assert [pytest.approx(0.70)] * 2 == [r["mean_of_accuracies"] for r in results]
    assert all(r["mean_of_accuracies"] != pytest.approx(r["from_counts"]) for r in results)


def test_a_rank_without_examples_still_takes_part_in_the_count_all_reduce() -> None:
    """A rank holding (0, 0) all-reduces its zeros like every other rank; the accuracy is that of the others."""
    results = launch(metrics_rank_body, 3, [(90, 100), (0, 0), (10, 20)])
    assert [100 / 120] * 3 == [r["from_counts"] for r in results]
