"""The ``count_group`` reading from counts built by hand: the ratios a count reduced over each group of a mesh gives,
read back as that group, and the right weights or a re-weighting of another shape read as none."""

from __future__ import annotations

import math

import pytest

from harness.core.mesh import Mesh
from harness.diagnosis.count_groups import count_group, counts_over, mesh_factor
from harness.diagnosis.fit import Block

# Token rank t's count in each of two microbatches (dp=2,cp=2: t = 2 * dp + cp); chunks of unequal counts.
COUNTS = {0: (104, 76), 1: (59, 51), 2: (189, 73), 3: (169, 72)}


def blocks(counts: dict[int, tuple[int, ...]] = COUNTS) -> list[Block]:
    return [Block(t, m, n) for t, ns in counts.items() for m, n in enumerate(ns)]


def ratios(mesh: Mesh, dims: tuple[str, ...], factor: float = 1.0,
           counts: dict[int, tuple[int, ...]] = COUNTS) -> list[float]:
    """``w * N`` of every block when the count is reduced over ``dims`` and the loss scaled by ``factor`` x T."""
    per = {t: sum(ns) for t, ns in counts.items()}
    n = sum(per.values())
    over = counts_over(mesh, per, dims)
    return [factor * n / over[b.rank] for b in blocks(counts)]


def test_the_count_over_each_token_rank_group_is_its_group() -> None:
    mesh = Mesh.parse("dp=2,cp=2")
    over_dp = counts_over(mesh, {t: sum(ns) for t, ns in COUNTS.items()}, ("dp",))
    assert {0: 104 + 76 + 189 + 73, 2: 442, 1: 59 + 51 + 169 + 72, 3: 351} == over_dp
    sig = count_group(blocks(), ratios(mesh, ("dp",)), mesh)
    assert sig is not None and "count_group" == sig.name
    assert sig.sentence.startswith("the count was reduced over dp (2 ranks); this window's tokens are spread over "
                                   "dp x cp (4 ranks)"), sig.sentence
    assert "ranks 0 and 2 (cp 0) (their group's count 442 of N=793) weigh 1.79x" in sig.sentence
    cp = count_group(blocks(), ratios(mesh, ("cp",)), mesh)
    assert cp is not None and cp.sentence.startswith("the count was reduced over cp (2 ranks)"), cp


def test_each_rank_s_own_count_reads_as_a_mean_of_the_shards_local_means() -> None:
    mesh = Mesh.parse("dp=2,cp=2")
    sig = count_group(blocks(), ratios(mesh, (), factor=1 / 4), mesh)
    assert sig is not None and "a mean of the shards' local means" in sig.sentence, sig
    assert "rank 1 (dp 0, cp 1) (its own count 110 of N=793) weigh 1.8x" in sig.sentence


def test_a_factor_from_the_wrong_group_is_named_beside_the_count() -> None:
    """The count and the factor both from dp: each chunk N/N_dp, times dp/T = 1/2."""
    mesh = Mesh.parse("dp=2,cp=2")
    sig = count_group(blocks(), ratios(mesh, ("dp",), factor=0.5), mesh)
    assert sig is not None and "reduced over dp" in sig.sentence
    assert ("a common factor 0.5x (the loss was scaled by dp's size or cp's size (2) where the token group's size "
            "(dp x cp: 4) belongs)") in sig.sentence, sig.sentence


def test_on_balanced_counts_every_group_of_that_share_is_named_and_the_factor_exact() -> None:
    mesh = Mesh.parse("dp=2,cp=2")
    even = {t: (30, 38) for t in range(4)}
    sig = count_group(blocks(even), ratios(mesh, ("dp",), counts=even), mesh)
    assert sig is not None
    assert "reduced over dp (2 ranks) or cp (2 ranks)" in sig.sentence and "every weight is 2.00x" in sig.sentence


def test_a_count_across_tp_counts_each_token_once_per_tp_rank() -> None:
    mesh = Mesh.parse("dp=2,tp=2")
    counts = {0: (50, 31), 1: (70, 64)}
    assert {0: 2 * 215, 1: 2 * 215} == counts_over(mesh, {0: 81, 1: 134}, ("dp", "tp"))
    sig = count_group(blocks(counts), ratios(mesh, ("dp", "tp"), counts=counts), mesh)
    assert sig is not None and "reduced over dp x tp (4 ranks)" in sig.sentence
    assert "the ranks of tp hold the same tokens, so the count holds each 2 times: every weight is 0.50x" in \
        sig.sentence


@pytest.mark.parametrize("q", [
    [1.0] * 8,  # the right weights
    [1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # one block off: no group gives that
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, math.nan],
])
def test_right_weights_or_another_shape_read_as_no_group(q: list[float]) -> None:
    """The negative controls: the reading names a group only where one explains every ratio."""
    assert count_group(blocks(), q, Mesh.parse("dp=2,cp=2")) is None


def test_a_one_dimensional_mesh_has_no_other_group() -> None:
    assert count_group(blocks(), [2.0] * 8, Mesh.parse("dp=4")) is None


def test_a_common_scale_is_named_as_one_mesh_size_over_the_token_group_s() -> None:
    mesh = Mesh.parse("dp=2,tp=2")
    assert "the loss was scaled by the world size (4) where the token group's size (dp: 2) belongs" == \
        mesh_factor(2.0, mesh)
    assert mesh_factor(1.0, mesh) is None and mesh_factor(3.0, mesh) is None
    assert "the loss was not scaled by the token group's size (dp x cp: 4)" == \
        mesh_factor(0.25, Mesh.parse("dp=2,cp=2"))
    # HSDP, torchtitan #2318: the shard group's size where the token group's belongs (both groups of 2 named).
    assert ("the loss was scaled by dp_replicate's size or dp_shard's size (2) where the token group's size "
            "(dp_replicate x dp_shard: 4) belongs") == mesh_factor(0.5, Mesh.parse("dp_replicate=2,dp_shard=2"))


def test_where_an_empty_coordinate_makes_a_group_s_count_one_rank_s_both_are_named() -> None:
    """one_empty: data rank 0 holds no token, so over dp each shard's group count is its own; the reading names dp
    first and says the counts cannot tell it from no reduction at all."""
    mesh = Mesh.parse("dp=2,cp=2")
    counts = {0: (0, 0), 1: (0, 0), 2: (189, 73), 3: (169, 72)}
    sig = count_group(blocks(counts), ratios(mesh, ("dp",), counts=counts), mesh)
    assert sig is not None
    assert sig.sentence.startswith("the count was reduced over dp (2 ranks) or no group at all (each rank's own count: "
                                   "these counts cannot tell the two apart)"), sig.sentence
