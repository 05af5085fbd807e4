"""The battery's scenarios, built on one process: no scenario holds the equal counts that would make a wrong
normalization exact, and every one holds both kinds of rows the corpus has (with a prompt and without)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from harness.battery import scenarios
from harness.core.microbatch import IGNORE_INDEX, Microbatch

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


# Symmetries a normalization hides behind. A mistake that is exact under one of them passes every scenario that keeps
# it: a sequence mean over a rank's own rows where every rank holds as many supervised rows, a per-microbatch
# sample-count ratio (rows_i / rows) where every microbatch holds as many rows (it is 1/k), and a count rounded to
# float16 or bfloat16 where every count is one those dtypes hold exactly.
Family = dict[str, Callable[[int], list]]


def _supervised_rows(mbs: list) -> int:
    return sum(int((mb.labels != IGNORE_INDEX).any(dim=1).sum()) for mb in mbs)


def _rounds(n: int, dtype: torch.dtype) -> bool:
    return int(torch.tensor(float(n), dtype=torch.float64).to(dtype).double()) != n


def symmetries_kept(family: Family, world: int) -> list[str]:
    """The symmetries ``family`` leaves equal at ``world`` ranks: in most of its scenarios with tokens (at W >= 2)
    every rank holds as many supervised rows, or every rank's microbatches hold as many rows; or none of its window
    counts rounds in float16 (odd, over 2048), or in bfloat16 (over 256, no multiple of the spacing)."""
    built = {name: build(world) for name, build in family.items()}
    with_tokens = {n: ws for n, ws in built.items() if any(mb.supervised for w in ws for r in w for mb in r)}
    counts = [sum(mb.supervised for r in w for mb in r) for ws in with_tokens.values() for w in ws]
    kept = []
    rank_rows = [n for n, ws in with_tokens.items()
                 if all(len({_supervised_rows(r) for r in w}) == 1 for w in ws)]
    if world > 1 and 2 * len(rank_rows) >= len(with_tokens):
        kept.append(f"equal supervised rows per rank in {len(rank_rows)} of {len(with_tokens)} scenarios")
    several = {n: ws for n, ws in with_tokens.items() if any(len(r) > 1 for w in ws for r in w)}
    mb_rows = [n for n, ws in several.items()
               if all(len({mb.inputs.shape[0] for mb in r}) == 1 for w in ws for r in w)]
    if 2 * len(mb_rows) >= len(several):
        kept.append(f"equal rows per microbatch in {len(mb_rows)} of {len(several)} scenarios")
    if not any(n > scenarios.FP16_EXACT and _rounds(n, torch.float16) for n in counts):
        kept.append("no count that rounds in float16")
    if not any(_rounds(n, torch.bfloat16) for n in counts):
        kept.append("no count that rounds in bfloat16")
    return kept


BATTERY_FAMILY: Family = {name: functools.partial(scenarios.build, name) for name in scenarios.BATTERY_SCENARIOS}


def _family_at(world: int) -> Family:
    return {n: b for n, b in BATTERY_FAMILY.items() if not (n in scenarios.MULTI_RANK_ONLY and world == 1)}


@pytest.mark.parametrize("world", range(1, 5), ids=lambda w: f"world{w}")
def test_the_battery_scenarios_break_every_symmetry_a_normalization_hides_behind(world: int) -> None:
    """At every default world size (so also at --battery-world-sizes 2, 4 and 2,4): ranks hold different numbers of
    supervised rows and microbatches different numbers of rows in most scenarios, and one window count rounds in
    float16 and one in bfloat16."""
    assert [] == symmetries_kept(_family_at(world), world)


def _edited(family: Family, edit: Callable[[list], list]) -> Family:
    """``family`` with ``edit`` applied to each window (``window[rank][microbatch]``)."""
    return {n: (lambda w, b=b: [edit(window) for window in b(w)]) for n, b in family.items()}


def _rows(mb: Microbatch, n: int) -> Microbatch:
    return Microbatch(mb.inputs[:n], mb.labels[:n])


def _equal_rank_rows(window: list) -> list:
    """Microbatch i of every rank cut to the fewest rows any rank holds there."""
    least = [min(rank[i].inputs.shape[0] for rank in window) for i in range(len(window[0]))]
    return [[_rows(mb, n) for mb, n in zip(rank, least)] for rank in window]


def _equal_microbatch_rows(window: list) -> list:
    """Each rank's microbatches cut to the fewest rows among them."""
    return [[_rows(mb, min(m.inputs.shape[0] for m in rank)) for mb in rank] for rank in window]


def _count_held_by(dtype: torch.dtype) -> Callable[[list], list]:
    """Targets masked, one at a time, until the window's count is one ``dtype`` holds exactly."""
    def edit(window: list) -> list:
        window = [list(rank) for rank in window]
        while _rounds(sum(mb.supervised for r in window for mb in r), dtype):
            rank = max(window, key=lambda r: sum(mb.supervised for mb in r))
            i = max(range(len(rank)), key=lambda j: rank[j].supervised)
            rank[i] = scenarios._first_target_masked(rank[i])
        return window
    return edit


SYMMETRIC_FAMILIES = {
    "equal_rank_rows": (_equal_rank_rows, "equal supervised rows per rank"),
    "equal_microbatch_rows": (_equal_microbatch_rows, "equal rows per microbatch"),
    "fp16_exact_counts": (_count_held_by(torch.float16), "no count that rounds in float16"),
    "bf16_exact_counts": (_count_held_by(torch.bfloat16), "no count that rounds in bfloat16"),
}
"""The battery's scenarios with one symmetry restored: each is the negative control of the test above."""


@pytest.mark.parametrize(("edit", "world"), [(e, w) for e in SYMMETRIC_FAMILIES for w in range(1, 5)
                                             if not (e == "equal_rank_rows" and w == 1)], ids=lambda x: f"{x}")
def test_a_scenario_family_that_keeps_one_symmetry_is_rejected_naming_it(edit: str, world: int) -> None:
    """Negative control: the battery's scenarios with one symmetry restored (rows cut to the fewest, targets masked
    until the count is exact) are reported with that symmetry."""
    fn, name = SYMMETRIC_FAMILIES[edit]
    kept = symmetries_kept(_edited(_family_at(world), fn), world)
    assert any(k.startswith(name) for k in kept), kept


def test_the_balanced_window_keeps_every_rank_symmetry() -> None:
    """The balanced window, built to hold one count on every rank, keeps equal rows per rank and per microbatch."""
    kept = symmetries_kept({"balanced": scenarios.balanced}, 2)
    assert {"equal supervised rows per rank", "equal rows per microbatch"} <= {k.split(" in ")[0] for k in kept}
