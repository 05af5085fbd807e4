"""The pipeline readings by formula from schedule steps and weights built by hand: each accumulation mistake's ratios
read back as that mistake, and the right weights or a re-weighting of another shape read as none; the mean of the
schedule microbatches' means read per row; and the rows a step held, recovered from its stacked batch."""

from __future__ import annotations

import pytest
import torch

from harness.core.mesh import Mesh
from harness.core.microbatch import Microbatch
from harness.diagnosis.count_groups import count_group
from harness.diagnosis.fit import Block
from harness.diagnosis.pipeline import (
    block_means_reading,
    chunks_of,
    formula_reading,
    microbatch_means_ratios,
    microbatch_means_reading,
    step_of,
)
from harness.distributed.pipeline import Pipeline, ScheduleStep, chunk_of, rows_of

# One token rank's window of three microbatches (4, 3 and 2 rows).
ROWS = (4, 3, 2)
BLOCKS = [Block(0, m, 10 + m, rows=r) for m, r in enumerate(ROWS)]


def steps(parts: list[list[int]], m: int = 2, scale: bool = True) -> list[ScheduleStep]:
    """The schedule steps holding the microbatches of ``parts``, M=``m``, scale_grads ``scale``."""
    return [ScheduleStep(m, scale, tuple((i, j) for i in part for j in range(ROWS[i]))) for part in parts]


def read(q: list[float], parts: list[list[int]], m: int = 2, scale: bool = True, pp: int = 2) -> str | None:
    sig = formula_reading(BLOCKS, q, {0: steps(parts, m, scale)}, pp)
    return None if sig is None else sig.name


def test_scale_grads_over_two_steps_reads_as_the_moving_average() -> None:
    """torchtitan #1733 at M=2, A=2: step 0's microbatches weigh 1/2, step 1's 1; the sentence gives the formula."""
    sig = formula_reading(BLOCKS, [0.5, 0.5, 1.0], {0: steps([[0, 1], [2]])}, 2)
    assert sig is not None and "pp_scale_grads" == sig.name
    assert sig.sentence.startswith("scale_grads rescaled each step: an exponential moving average over the window's "
                                   "2 steps (step 0's gradient weighs 1/M^1 = 0.5, step 1's 1)"), sig.sentence
    assert "pp_scale_grads" == read([0.25, 0.5, 1.0], [[0], [1], [2]])  # A=3: 1/M^2, 1/M, 1
    assert "pp_scale_grads" == read([1 / 16, 0.25, 1.0], [[0], [1], [2]], m=4)


def test_the_last_step_alone_the_extra_division_and_the_count_over_pp() -> None:
    assert "pp_last_step_only" == read([0.0, 0.0, 1.0], [[0, 1], [2]])
    assert "pp_divided_by_microbatches" == read([0.25, 0.25, 0.5], [[0, 1], [2]])  # prod_{b >= a} 1/M_b
    assert "count_group" == read([0.5, 0.5, 0.5], [[0, 1], [2]], scale=False)  # 1/pp, scale_grads off
    # One step of M=2 under scale_grads=True and a count over pp=2 give the same numbers: both are named.
    sig = formula_reading(BLOCKS, [0.5, 0.5, 0.5], {0: steps([[0, 1, 2]])}, 2)
    assert sig is not None and "pp_divided_by_microbatches" == sig.name
    assert "also read count_group" in sig.sentence


def test_the_right_weights_and_other_shapes_read_as_none() -> None:
    """The negative controls: the right weights; a microbatch counted twice; scale_grads's weights where the recorded
    steps turned it off; weights of the right shape a little off; a microbatch spread over two steps; steps that held
    rows of their own."""
    assert read([1.0, 1.0, 1.0], [[0, 1], [2]]) is None
    assert read([1.0, 2.0, 1.0], [[0, 1], [2]]) is None
    assert read([0.5, 0.5, 1.0], [[0, 1], [2]], scale=False) is None
    assert read([0.5, 0.51, 1.0], [[0, 1], [2]]) is None
    spread = [ScheduleStep(2, True, ((0, 0), (0, 1), (1, 0))), ScheduleStep(2, True, ((0, 2), (0, 3), (1, 1),
                                                                                      (1, 2), (2, 0), (2, 1)))]
    assert step_of(BLOCKS[0], spread) is None
    assert formula_reading(BLOCKS, [0.5, 0.5, 1.0], {0: spread}, 2) is None
    foreign = [s._replace(foreign=1) for s in steps([[0, 1], [2]])]  # a step held rows the window does not
    assert formula_reading(BLOCKS, [0.5, 0.5, 1.0], {0: foreign}, 2) is None


def test_a_count_over_dp_x_pp_is_named_by_count_group_and_over_pp_alone_by_the_formula() -> None:
    """Over dp x pp the existing mesh reading names the group (every weight 1/pp); over pp alone it cannot (one
    dimension), and the formula reading does."""
    two = [Block(t, m, 10 + m + t, rows=r) for t in range(2) for m, r in enumerate(ROWS)]
    sig = count_group(two, [0.5] * 6, Mesh.parse("dp=2,pp=2"))
    assert sig is not None and "count_group" == sig.name and "reduced over pp x dp (4 ranks)" in sig.sentence, sig
    assert count_group(BLOCKS, [0.5] * 3, Mesh.parse("pp=2")) is None
    assert "count_group" == read([0.5, 0.5, 0.5], [[0, 1], [2]], scale=False)


def test_the_rows_a_step_held_are_recovered_from_its_stacked_batch() -> None:
    """Pipeline.batch's stacked, padded rows map back to the window's (microbatch, row); a row that is none of the
    window's is counted as foreign."""
    g = torch.Generator().manual_seed(0)
    window = [Microbatch(torch.randint(1, 10, (2, 5), generator=g), torch.randint(1, 10, (2, 5), generator=g)),
              Microbatch(torch.randint(1, 10, (1, 8), generator=g), torch.randint(1, 10, (1, 8), generator=g))]
    inputs, labels = Pipeline.batch(window[1:], 2)
    assert ([(1, 0)], 0) == rows_of(window, inputs, labels)
    inputs, labels = Pipeline.batch(window, 2)
    assert ([(0, 0), (0, 1), (1, 0)], 0) == rows_of(window, inputs, labels)
    labels[1, 0] = 3 if int(labels[1, 0]) != 3 else 4
    assert ([(0, 0), (1, 0)], 1) == rows_of(window, inputs, labels)


@pytest.mark.parametrize("batch_rows", [1, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_a_row_lies_in_the_chunk_torch_tensor_split_gives_it(batch_rows: int, m: int) -> None:
    """chunk_of follows torch.tensor_split along dim 0, the split torch's pipelining applies to a step's batch: the
    first rows % M chunks one row longer, and empty chunks where M > rows."""
    chunks = torch.tensor_split(torch.arange(batch_rows), m)
    assert [k for k, c in enumerate(chunks) for _ in c] == [chunk_of(p, batch_rows, m) for p in range(batch_rows)]


def test_a_position_outside_the_batch_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="position=4 must lie in a batch of batch_rows=4 rows"):
        chunk_of(4, 4, 2)


# Two token ranks' rows for the mean of means: rank 0's microbatch 0 of 4 rows, its microbatch 1 of 3; rank 1's
# microbatch 0 of 2 rows, its microbatch 1 of 2. Each microbatch is one step of M=2 (A=2, K=4), the 3 rows padded to 4.
TOKENS = {(0, 0): (5, 7, 3, 9), (0, 1): (4, 6, 2), (1, 0): (8, 2), (1, 1): (0, 10)}
ROW_BLOCKS = [Block(t, m, n, row=j) for (t, m), ns in TOKENS.items() for j, n in enumerate(ns)]
MEANS_STEPS = {t: [ScheduleStep(2, False, tuple((m, j) for j in range(len(TOKENS[(t, m)]))),
                                batch_rows=-(-len(TOKENS[(t, m)]) // 2) * 2, at=tuple(range(len(TOKENS[(t, m)]))))
                   for m in (0, 1)] for t in (0, 1)}


def test_each_row_weighs_one_over_its_schedule_microbatch_count_times_k_times_t() -> None:
    """By hand: N = 56, K = 4, T = 2; rank 0's first step splits 5+7 | 3+9, its second 4+6 | 2 (+ a padding row);
    rank 1's steps 8 | 2 and 0 | 10 (one row each). A row's ratio is N / (n_k K T)."""
    n, k, t = 56, 4, 2
    assert n == sum(b.tokens for b in ROW_BLOCKS)
    counts = [12, 12, 12, 12, 10, 10, 2, 8, 2, 0, 10]
    expected = [n / (c * k * t) if c else float("nan") for c in counts]
    expected[9] = float("nan")  # a row without a supervised token has no weight to read
    got = microbatch_means_ratios(ROW_BLOCKS, MEANS_STEPS, t)
    assert got is not None
    torch.testing.assert_close(torch.tensor(expected), torch.tensor(got), equal_nan=True, rtol=1e-12, atol=0.0)
    where = chunks_of(ROW_BLOCKS, MEANS_STEPS)
    assert where is not None and (1, 1, 2) == where[(0, 1, 2)][1:]  # rank 0's step 1, chunk 1, n_k = 2


def test_the_mean_of_schedule_microbatch_means_is_read_and_named_by_its_formula() -> None:
    """Ratios built from the formula (within the row fit's tolerance) read pp_microbatch_means; the sentence names K,
    T and the heaviest and lightest schedule microbatches."""
    q = [v if v == v else 0.0 for v in microbatch_means_ratios(ROW_BLOCKS, MEANS_STEPS, 2) or []]
    q = [v * (1 + 2e-4 * (-1) ** i) for i, v in enumerate(q)]  # the per-row fit's own scatter
    sig = microbatch_means_reading(ROW_BLOCKS, q, MEANS_STEPS, 2)
    assert sig is not None and "pp_microbatch_means" == sig.name
    assert "K = M x A = 4 schedule microbatches, averaged over the token group's 2 ranks" in sig.sentence, sig.sentence
    assert "rank 0's step 1, microbatch 1 (n_k=2 of N=56) weighs 3.5x" in sig.sentence, sig.sentence


def test_the_mean_of_means_does_not_read_other_weights_or_rows_it_cannot_place() -> None:
    """The negative controls: the right weights; a mean per row (each sequence's own mean over the window's 10
    supervised rows); the formula's weights where the recorded batch put a row across a cut (other n_k); steps
    without batch positions; a step that held rows the window does not; a schedule whose chunks are all as full
    (the formula predicts the right weights: no candidate)."""
    n = 56
    assert microbatch_means_reading(ROW_BLOCKS, [1.0] * len(ROW_BLOCKS), MEANS_STEPS, 2) is None
    per_row = [n / (b.tokens * 10) if b.tokens else 0.0 for b in ROW_BLOCKS]
    assert microbatch_means_reading(ROW_BLOCKS, per_row, MEANS_STEPS, 2) is None
    right = microbatch_means_ratios(ROW_BLOCKS, MEANS_STEPS, 2) or []
    # Rank 0's first step held row 1 after row 2: its chunks hold 5+3 | 7+9, not 5+7 | 3+9.
    moved = {**MEANS_STEPS, 0: [MEANS_STEPS[0][0]._replace(at=(0, 2, 1, 3)), MEANS_STEPS[0][1]]}
    assert microbatch_means_reading(ROW_BLOCKS, right, moved, 2) is None
    bare = {t: [s._replace(at=()) for s in steps] for t, steps in MEANS_STEPS.items()}
    assert microbatch_means_reading(ROW_BLOCKS, right, bare, 2) is None
    foreign = {t: [s._replace(foreign=1) for s in steps] for t, steps in MEANS_STEPS.items()}
    assert microbatch_means_reading(ROW_BLOCKS, right, foreign, 2) is None
    even = [Block(0, 0, 6, row=j) for j in range(4)]
    even_steps = {0: [ScheduleStep(2, False, tuple((0, j) for j in range(4)), batch_rows=4, at=(0, 1, 2, 3))]}
    assert [1.0] * 4 == microbatch_means_ratios(even, even_steps, 1) or []
    assert microbatch_means_reading(even, [1.0] * 4, even_steps, 1) is None


def test_the_mean_of_means_reads_on_microbatch_weights_only_where_each_microbatch_fills_one_chunk() -> None:
    """One step of M=2 holding microbatch 0 (rows of 3 and 5 tokens) and microbatch 1 (rows of 1 and 1): each
    microbatch is one schedule microbatch, so the block ratios N / (n_k K T) = 10/16 and 10/4 read; where the chunks
    cut through the microbatches (rank 0 of the rows above), no block weight can say it, and the reading declines."""
    blocks = [Block(0, 0, 8), Block(0, 1, 2)]
    rows = [Block(0, 0, 3, row=0), Block(0, 0, 5, row=1), Block(0, 1, 1, row=0), Block(0, 1, 1, row=1)]
    steps = {0: [ScheduleStep(2, False, ((0, 0), (0, 1), (1, 0), (1, 1)), batch_rows=4, at=(0, 1, 2, 3))]}
    sig = block_means_reading(blocks, [10 / 16, 10 / 4], rows, steps, 1)
    assert sig is not None and "pp_microbatch_means" == sig.name
    assert block_means_reading(blocks, [10 / 16, 10 / 4 * 1.01], rows, steps, 1) is None
    assert block_means_reading(blocks, [1.0, 1.0], rows, steps, 1) is None
    cut = [Block(0, m, sum(TOKENS[(0, m)])) for m in (0, 1)]
    predicted = microbatch_means_ratios([b for b in ROW_BLOCKS if b.rank == 0], {0: MEANS_STEPS[0]}, 1) or []
    assert block_means_reading(cut, predicted[::4][:2], [b for b in ROW_BLOCKS if b.rank == 0],
                               {0: MEANS_STEPS[0]}, 1) is None
