"""The DistributedSampler epoch mode: disjoint shards that cover the dataset, a new order per epoch only with
``set_epoch``, and sampler padding and ``drop_last`` reported by the per-epoch example-ID audit (seeds 003, 004)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.sampling import audit, epoch_plan, epoch_shards, rank_seeded_shards

from harness.testing.hypothesis_profiles import load_profile

load_profile()

from harness.data.config import Config  # noqa: E402
from harness.data.corpus import make_corpus, split_rows  # noqa: E402


@pytest.fixture(params=(2, 3), ids=lambda w: f"world{w}")
def world_size(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def test_seed_004_shards_ten_items_over_three_ranks_with_padding() -> None:
    """Seed 004's output: every third index per rank, and the last two ranks padded with items 0 and 1."""
    assert [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]] == epoch_shards(10, 3, 0, shuffle=False)


def test_seed_004_drop_last_drops_the_tail() -> None:
    """Seed 004's drop_last practice: three items per rank, item 9 never read."""
    assert [[0, 3, 6], [1, 4, 7], [2, 5, 8]] == epoch_shards(10, 3, 0, shuffle=False, drop_last=True)


def test_seed_004_set_epoch_changes_the_shuffled_order() -> None:
    """Seed 004's output on rank 0 of 2: epoch 0 [4, 7, 3, 0, 6]; after set_epoch(1) [5, 1, 0, 9, 7]."""
    assert [4, 7, 3, 0, 6] == epoch_shards(10, 2, 0)[0]
    assert [5, 1, 0, 9, 7] == epoch_shards(10, 2, 1)[0]


def test_forgetting_set_epoch_replays_the_same_order_every_epoch() -> None:
    """Negative control for the reshuffle check: without set_epoch, epoch 1 is epoch 0 again (seed 004)."""
    assert [4, 7, 3, 0, 6] == epoch_shards(10, 2, 1, set_epoch=False)[0]
    assert epoch_shards(10, 2, 0) == epoch_shards(10, 2, 5, set_epoch=False)


def test_the_audit_reports_sampler_padding_as_duplicates() -> None:
    """Ten items on three ranks: twelve reads, items 0 and 1 twice, nothing omitted, shards not disjoint."""
    report = audit(epoch_shards(10, 3, 0, shuffle=False), 10)
    assert {0: 2, 1: 2} == report.duplicates
    assert () == report.omissions
    assert (0, 1) == report.overlaps
    assert report.covers and not report.exact and not report.disjoint


def test_the_audit_reports_drop_last_as_omissions() -> None:
    """With drop_last the shards are disjoint but item 9 is reported as never read."""
    report = audit(epoch_shards(10, 3, 0, shuffle=False, drop_last=True), 10)
    assert (9,) == report.omissions
    assert {} == report.duplicates
    assert report.disjoint and not report.covers


def test_the_audit_reports_the_overlap_of_rank_seeded_samplers(world_size: int) -> None:
    """Negative control for disjointness: a different seed per rank makes ranks read the same examples and skip
    others, and the audit names both."""
    report = audit(rank_seeded_shards(60, world_size, 0), 60)
    assert not report.disjoint
    assert report.omissions
    assert "read by several ranks" in report.summary()


@given(st.integers(1, 200), st.integers(1, 8), st.integers(0, 20), st.integers(0, 2**31 - 1))
def test_shards_are_disjoint_and_cover_the_dataset_when_it_divides_evenly(
    per_rank: int, world: int, epoch: int, seed: int
) -> None:
    """Whenever W divides the dataset, every epoch reads every example exactly once, each on one rank."""
    n = per_rank * world
    report = audit(epoch_shards(n, world, epoch, seed=seed), n)
    assert report.exact and report.disjoint
    assert (per_rank,) * world == report.per_rank


@given(st.integers(1, 200), st.integers(1, 8), st.integers(0, 20), st.booleans())
def test_padding_and_dropping_account_for_every_read(n: int, world: int, epoch: int, drop_last: bool) -> None:
    """Padding duplicates exactly ``ceil(n / W) * W - n`` reads; drop_last omits exactly ``n mod W`` examples."""
    report = audit(epoch_shards(n, world, epoch, drop_last=drop_last), n)
    if drop_last:
        assert n % world == len(report.omissions)
        assert {} == report.duplicates
    else:
        assert -(-n // world) * world - n == sum(k - 1 for k in report.duplicates.values())
        assert report.covers


def test_each_epoch_of_the_plan_reads_the_corpus_train_ids_once(world_size: int) -> None:
    """The epoch mode over the corpus's train rows: per epoch, the audit is exact when W divides the split, and the
    order changes from one epoch to the next."""
    config = Config(train_size=24)
    ids = [r.id for r in split_rows(make_corpus(config), "train")]
    plan = epoch_plan(ids, world_size, 3)
    assert [0, 1, 2] == [e.epoch for e in plan]
    for e in plan:
        assert e.audit.exact and e.audit.disjoint, e.audit.summary()
        assert sorted(ids) == sorted(i for shard in e.ids for i in shard)
    assert plan[0].ids != plan[1].ids


def test_the_plan_reports_duplicates_by_the_dataset_s_own_ids() -> None:
    """A duplicate is named by the example's ID, not by its position: the audit a person can look up."""
    plan = epoch_plan([100, 101, 102, 103, 104], 2, 1, shuffle=False)
    assert {100: 2} == plan[0].audit.duplicates


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: epoch_shards(0, 2, 0), "dataset_size=0"),
        (lambda: epoch_shards(10, 0, 0), "world_size=0"),
        (lambda: epoch_shards(10, 2, -1), "epoch=-1"),
        (lambda: audit([[0, 10]], 10), "example ID 10"),
        (lambda: epoch_plan([1, 1, 2], 2, 1), "unique"),
        (lambda: epoch_plan([1, 2], 2, 0), "epochs=0"),
    ],
    ids=["empty-dataset", "world0", "negative-epoch", "id-out-of-range", "repeated-ids", "no-epoch"],
)
def test_bad_arguments_are_refused_with_their_name(call: object, names: str) -> None:
    """Each invalid argument is named in the error."""
    with pytest.raises(ValueError, match=names):
        call()  # type: ignore[operator]
