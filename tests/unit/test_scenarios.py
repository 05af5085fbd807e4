"""The battery's scenarios, built on one process: no scenario holds the equal counts that would make a wrong
normalization exact, and every one holds both kinds of rows the corpus has (with a prompt and without)."""

from __future__ import annotations

import pytest

from harness.battery import scenarios
from harness.core.microbatch import IGNORE_INDEX

WORLDS = (*range(1, scenarios.MAX_WORLD_SIZE + 1), 16, scenarios.MAX_SCENARIO_WORLD_SIZE)
"""Every world size the command line runs, and two of the larger ones torchrun jobs run."""

CASES = [(name, world) for name in scenarios.BATTERY_SCENARIOS if name != "all_empty" for world in WORLDS
         if not (name in scenarios.MULTI_RANK_ONLY and world == 1)]
"""Every battery scenario with a supervised token, at the world sizes it runs at."""


def _ids(case: tuple[str, int]) -> str:
    return f"{case[0]}-W{case[1]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_a_ranks_supervised_microbatches_do_not_all_hold_one_count(case: tuple[str, int]) -> None:
    """Where a rank has two supervised microbatches or more, their counts are not all equal: equal counts make a sum
    of per-microbatch means (or a count from one microbatch) exact on that rank, and hide it."""
    name, world = case
    for k, window in enumerate(scenarios.build(name, world)):
        for rank, mbs in enumerate(window):
            counts = [mb.supervised for mb in mbs if mb.supervised > 0]
            assert len(counts) < 2 or len(set(counts)) > 1, f"window {k}, rank {rank}: counts {counts}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_nonempty_ranks_do_not_all_hold_one_total(case: tuple[str, int]) -> None:
    """Where two ranks or more hold supervised tokens, their totals are not all equal: equal totals make the mean of
    local means exact (the ``balanced`` window's blind spot)."""
    name, world = case
    for k, window in enumerate(scenarios.build(name, world)):
        totals = [t for t in (sum(mb.supervised for mb in mbs) for mbs in window) if t > 0]
        assert len(totals) < 2 or len(set(totals)) > 1, f"window {k}: rank totals {totals}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_scenario_holds_rows_with_a_prompt_and_rows_without(case: tuple[str, int]) -> None:
    """Both kinds of supervised rows are in its windows: a row without prompt (its first target supervised, what the
    hf format's ``labels = input_ids`` leaves a real token at position 0 for) and a row with one."""
    name, world = case
    unprompted = prompted = 0
    for window in scenarios.build(name, world):
        for mbs in window:
            for mb in mbs:
                supervised = (mb.labels != IGNORE_INDEX).any(dim=1)
                first = mb.labels[:, 0] != IGNORE_INDEX
                unprompted += int((supervised & first).sum())
                prompted += int((supervised & ~first).sum())
    assert unprompted > 0 and prompted > 0, f"{unprompted} rows without a prompt, {prompted} with one"


def equal_rank_counts(window: list) -> list[int]:
    """The ranks' supervised counts when two ranks hold the same count (or one holds none), else []."""
    counts = [sum(mb.supervised for mb in rank) for rank in window]
    return counts if len(set(counts)) < len(counts) or min(counts) == 0 else []


@pytest.mark.parametrize("world", [w for w in WORLDS if w > 1])
def test_every_rank_of_the_base_window_holds_its_own_token_count(world: int) -> None:
    """Rank r reads the r-th length band at any W: counts differ between every two ranks, so a mean of local means
    is never exact by accident."""
    assert [] == equal_rank_counts(scenarios.build("uneven", world)[0])


def test_equal_rank_counts_are_found() -> None:
    """The control of the one above: the balanced window, built to hold one count on every rank, is reported."""
    assert equal_rank_counts(scenarios.balanced(3)[0])


def test_up_to_four_ranks_the_scenarios_are_the_ones_every_figure_was_measured_on() -> None:
    """Past four ranks the corpus changes (shorter sequences, more of them); up to four it is the battery config's."""
    assert all(scenarios.corpus_config(w) is scenarios.BATTERY_CONFIG for w in range(1, scenarios.SMALL_WORLD + 1))
    assert scenarios.corpus_config(8).min_len < scenarios.BATTERY_CONFIG.min_len


def test_a_world_past_the_scenarios_is_refused_naming_the_limit() -> None:
    with pytest.raises(ValueError, match=f"between 1 and {scenarios.MAX_SCENARIO_WORLD_SIZE}"):
        scenarios.build("uneven", scenarios.MAX_SCENARIO_WORLD_SIZE + 1)
