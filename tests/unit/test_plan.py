"""The window plan: length bands per rank, plan[step][rank][microbatch] ids, and its failure modes."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from harness.data.config import Config
from harness.data.corpus import Row
from harness.data.plan import Plan, length_bands, make_plan, rank_pools


@pytest.fixture(scope="module", params=(2, 3, 4), ids=lambda w: f"world{w}")
def world(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(scope="module")
def plan(rows: list[Row], config: Config, world: int) -> Plan:
    return make_plan(rows, config, world_size=world)


def _window_ids(step: list[list[list[int]]]) -> list[int]:
    return [i for rank in step for mb in rank for i in mb]


# --- length bands ----------------------------------------------------------------------------------------------------


def test_two_rank_bands_split_at_64() -> None:
    """W=2 over max_len 128 gives (1, 64) and (65, 128): with min_len 16, the seed's 16-64 and 65-128."""
    assert [(1, 64), (65, 128)] == length_bands(2, 128)


@pytest.mark.parametrize(
    ("world_size", "expected"),
    [(3, [(1, 42), (43, 85), (86, 128)]), (4, [(1, 32), (33, 64), (65, 96), (97, 128)])],
    ids=["world3", "world4"],
)
def test_bands_for_three_and_four_ranks(world_size: int, expected: list[tuple[int, int]]) -> None:
    """Band r is (floor(128 r / W) + 1, floor(128 (r + 1) / W))."""
    assert expected == length_bands(world_size, 128)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7], ids=lambda w: f"world{w}")
def test_bands_are_contiguous_and_cover_zero_to_max_len(world_size: int) -> None:
    """The bands start at 1, end at max_len, and each starts right after the previous one ends."""
    bands = length_bands(world_size, 128)
    edges = [bands[0][0], *[hi + 1 - lo for (_, hi), (lo, _) in itertools.pairwise(bands)], bands[-1][1]]
    assert [1, *[0] * (world_size - 1), 128] == edges
    assert all(lo <= hi for lo, hi in bands)


@pytest.mark.parametrize("world_size", [0, -1, 2.0], ids=["zero", "negative", "float"])
def test_bands_reject_an_invalid_world_size(world_size: object) -> None:
    """world_size must be a positive integer; the error names it."""
    with pytest.raises(ValueError, match=rf"world_size={world_size!r}"):
        length_bands(world_size, 128)  # type: ignore[arg-type]


def test_bands_reject_max_len_below_world_size() -> None:
    """Fewer lengths than ranks cannot give every rank a band."""
    with pytest.raises(ValueError, match="max_len=3"):
        length_bands(4, 3)


# --- make_plan: shape and determinism --------------------------------------------------------------------------------


def test_plan_is_deterministic(rows: list[Row], config: Config, world: int, plan: Plan) -> None:
    """The same rows and config give the same plan."""
    assert plan == make_plan(rows, config, world_size=world)


def test_plan_depends_on_the_seed(rows: list[Row], config: Config) -> None:
    """Another config seed draws other windows from the same rows."""
    assert make_plan(rows, config, steps=5) != make_plan(rows, config.replace(seed=config.seed + 1), steps=5)


def test_plan_defaults_to_updates_steps_and_config_world_size(rows: list[Row], config: Config) -> None:
    """Without overrides the plan has config.updates (100) windows of config.world_size (2) ranks."""
    plan = make_plan(rows, config)
    assert (100, {2}) == (len(plan), {len(step) for step in plan})


def test_plan_shape_is_steps_by_world_by_accumulation_by_batch(config: Config, world: int, plan: Plan) -> None:
    """plan[step][rank][microbatch] holds batch_size_per_rank ids, accumulation microbatches per rank."""
    shapes = {(len(step), len(rank), len(mb)) for step in plan for rank in step for mb in rank}
    assert (config.updates, {(world, config.accumulation, config.batch_size_per_rank)}) == (len(plan), shapes)


def test_steps_override_sets_the_plan_length(rows: list[Row], config: Config) -> None:
    """steps=7 gives seven windows, steps=0 none."""
    assert (7, 0) == (len(make_plan(rows, config, steps=7)), len(make_plan(rows, config, steps=0)))


def test_a_shorter_plan_is_a_prefix_of_a_longer_one(rows: list[Row], config: Config) -> None:
    """The windows of step k do not depend on how many steps are planned: a resumed run sees the same data."""
    assert make_plan(rows, config, steps=100)[:10] == make_plan(rows, config, steps=10)


# --- make_plan: which ids ------------------------------------------------------------------------------------------


def test_every_id_of_a_rank_lies_in_its_band_and_is_a_train_row(
    rows: list[Row], config: Config, world: int, plan: Plan
) -> None:
    """Rank r reads only training rows whose length lies in the r-th length band."""
    bands = length_bands(world, config.max_len)
    misplaced = [
        (s, r, i)
        for s, step in enumerate(plan)
        for r, rank in enumerate(step)
        for mb in rank
        for i in mb
        if rows[i].split != "train" or not bands[r][0] <= len(rows[i].tokens) <= bands[r][1]
    ]
    assert [] == misplaced


def test_no_id_repeats_within_a_window(plan: Plan) -> None:
    """Within one window, across ranks and microbatches, every id is distinct."""
    repeats = [s for s, step in enumerate(plan) if len(set(_window_ids(step))) != len(_window_ids(step))]
    assert [] == repeats


def test_an_id_returns_in_a_later_window(plan: Plan) -> None:
    """Windows draw with replacement across steps: over 100 steps some id appears in more than one window."""
    seen = Counter(i for step in plan for i in set(_window_ids(step)))
    assert max(seen.values()) > 1


def test_rank_lengths_are_uneven(rows: list[Row], config: Config, plan: Plan) -> None:
    """Rank 0 reads shorter sequences than the last rank in every window: the split the bias needs."""

    def longest(step: list[list[list[int]]], rank: int) -> int:
        return max(len(rows[i].tokens) for mb in step[rank] for i in mb)

    def shortest(step: list[list[list[int]]], rank: int) -> int:
        return min(len(rows[i].tokens) for mb in step[rank] for i in mb)

    assert all(longest(step, 0) < shortest(step, len(step) - 1) for step in plan)


def test_rank_pools_hold_only_train_rows_of_their_band(rows: list[Row], config: Config) -> None:
    """rank_pools partitions the training rows by band: together they hold every training id once."""
    pools = rank_pools(rows, 2, config.max_len)
    train_ids = [r.id for r in rows if r.split == "train"]
    assert sorted(train_ids) == sorted(pools[0] + pools[1])


# --- make_plan: invalid input ----------------------------------------------------------------------------------------


def _short_rows(n_train: int, n_val: int) -> list[Row]:
    """n_train training rows of length 20 (band 0 for W=2), n_val validation rows of the same length, and 20 long
    training rows (band 1)."""
    short, long = tuple(range(1, 21)), tuple(range(1, 101))
    specs = [("train", short)] * n_train + [("val", short)] * n_val + [("train", long)] * 20
    return [Row(id=i, split=split, tokens=tokens, prompt_len=0) for i, (split, tokens) in enumerate(specs)]


def test_a_band_too_small_for_the_window_raises_naming_world_size_and_the_fix(config: Config) -> None:
    """Band 0 with 7 training rows (and 50 validation rows, which do not count) cannot fill a window of 2 x 4 ids."""
    with pytest.raises(ValueError, match=r"world_size=2.*rank 0.*holds 7.*raise train_size or lower world_size"):
        make_plan(_short_rows(7, 50), config, world_size=2)


def test_a_band_of_exactly_one_window_gives_every_row_each_step(config: Config) -> None:
    """With exactly 2 x 4 training rows in band 0 the plan is valid and rank 0 reads all of them in every window."""
    plan = make_plan(_short_rows(8, 0), config, world_size=2, steps=3)
    assert [list(range(8))] * 3 == [sorted(i for mb in step[0] for i in mb) for step in plan]


@pytest.mark.parametrize("steps", [-1, 1.5, "3"], ids=["negative", "float", "str"])
def test_invalid_steps_raise(rows: list[Row], config: Config, steps: object) -> None:
    """steps must be a non-negative integer; the error names it."""
    with pytest.raises(ValueError, match=rf"steps={steps!r}"):
        make_plan(rows, config, steps=steps)  # type: ignore[arg-type]
