"""Context parallelism's data (``harness.data.context_parallel``): the cp ranks of one data coordinate hold every
supervised position exactly once, under either chunking, at any sequence length."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.data.context_parallel import CHUNKINGS, chunks_of, positions, shard_chunk, supervise_chunk
from harness.testing.hypothesis_profiles import load_profile

load_profile()


def held_counts(masks: list[torch.Tensor]) -> torch.Tensor:
    """How many cp ranks hold each position."""
    return torch.stack(masks).sum(0)


@given(st.integers(1, 96), st.integers(1, 5), st.sampled_from(CHUNKINGS))
def test_the_cp_ranks_hold_every_position_exactly_once(length: int, cp: int, chunking: str) -> None:
    """Whatever the length, the cp ranks' positions partition the sequence."""
    masks = [positions(length, i, cp, chunking) for i in range(cp)]
    assert torch.equal(torch.ones(length, dtype=torch.long), held_counts(masks))


def test_the_partition_check_rejects_a_rank_that_counts_load_balanced_chunks_as_contiguous() -> None:
    """Its negative control: at cp=2 over 8 positions, rank 0 taking the contiguous half while rank 1 holds its
    load-balanced chunks leaves positions 2-3 held twice and 6-7 by no one: not a partition."""
    masks = [positions(8, 0, 2, "contiguous"), positions(8, 1, 2, "load_balanced")]
    assert [1, 1, 2, 2, 1, 1, 0, 0] == held_counts(masks).tolist()
    assert not torch.equal(torch.ones(8, dtype=torch.long), held_counts(masks))


def test_load_balanced_chunks_pair_the_first_with_the_last() -> None:
    """At cp=2, rank 0 holds chunks 0 and 3 of 4, rank 1 chunks 1 and 2: over 8 positions, 0-1 and 6-7 for rank 0."""
    assert ((0, 3), (1, 2)) == (chunks_of(0, 2, "load_balanced"), chunks_of(1, 2, "load_balanced"))
    assert [1, 1, 0, 0, 0, 0, 1, 1] == positions(8, 0, 2, "load_balanced").long().tolist()
    assert [1, 1, 1, 1, 0, 0, 0, 0] == positions(8, 0, 2, "contiguous").long().tolist()


@st.composite
def microbatches(draw: st.DrawFn) -> Microbatch:
    rows, length = draw(st.integers(1, 4)), draw(st.integers(1, 24))
    labels = torch.tensor(draw(st.lists(st.lists(st.sampled_from([IGNORE_INDEX, 3, 7]), min_size=length,
                                                 max_size=length), min_size=rows, max_size=rows)))
    factors = torch.arange(1, rows * length + 1, dtype=torch.float64).view(rows, length) / 7
    weights = torch.where(labels != IGNORE_INDEX, factors, torch.zeros_like(factors))
    return Microbatch(torch.ones(rows, length, dtype=torch.int64), labels, weights)


@given(microbatches(), st.integers(1, 4), st.sampled_from(CHUNKINGS))
def test_each_supervised_token_counts_once_over_the_cp_ranks(mb: Microbatch, cp: int, chunking: str) -> None:
    """The cp ranks' supervised counts add up to the microbatch's, each keeps the inputs and the labels it holds,
    and a per-token factor follows its label."""
    shards = [supervise_chunk(mb, i, cp, chunking) for i in range(cp)]
    assert mb.supervised == sum(s.supervised for s in shards)
    for s in shards:
        assert torch.equal(mb.inputs, s.inputs)
        kept = s.labels != IGNORE_INDEX
        assert torch.equal(mb.labels[kept], s.labels[kept])
        assert s.weights is not None and mb.weights is not None
        assert torch.equal(s.weights[~kept & (mb.labels != IGNORE_INDEX)], torch.zeros_like(
            s.weights[~kept & (mb.labels != IGNORE_INDEX)]))
    total = sum(s.weights for s in shards)  # type: ignore[misc]
    supervised = mb.labels != IGNORE_INDEX
    assert torch.equal(mb.weights[supervised], total[supervised])  # type: ignore[index]


@pytest.mark.parametrize(("args", "says"), [
    ((0, 2, "striped"), "chunking='striped' must be one of contiguous, load_balanced"),
    ((2, 2, "contiguous"), "cp_rank=2 is outside a cp dimension of size 2"),
])
def test_a_bad_chunking_or_rank_is_refused_naming_it(args: tuple[int, int, str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        chunks_of(*args)


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("cp", [2, 3])
def test_the_shards_of_a_microbatch_are_its_columns_once_each_with_their_positions(cp: int, chunking: str) -> None:
    """``shard_chunk``: every column of the microbatch is in exactly one cp rank's chunk, with its position; the
    chunk's labels are the whole microbatch's at those positions. Its control: a chunk's positions are not 0..t-1
    under load balancing (its second chunk sits near the end)."""
    mb = _microbatch(rows=2, length=11)
    seen: list[int] = []
    for r in range(cp):
        part = shard_chunk(mb, r, cp, chunking)
        assert part.positions is not None
        cols = part.positions[0].tolist()
        seen += cols
        assert torch.equal(part.labels, mb.labels[:, cols]) and torch.equal(part.inputs, mb.inputs[:, cols])
    assert sorted(seen) == list(range(11))
    last = shard_chunk(mb, 0, cp, chunking).positions
    assert last is not None
    assert (last[0].tolist() == list(range(last.shape[1]))) == (chunking == "contiguous")


def _microbatch(rows: int, length: int) -> Microbatch:
    inputs = torch.arange(rows * length, dtype=torch.int64).view(rows, length) % 31 + 1
    labels = inputs.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    return Microbatch(inputs, labels)
