"""The pipeline readings by formula from schedule steps and weights built by hand: each accumulation mistake's ratios
read back as that mistake, and the right weights or a re-weighting of another shape read as none; and the rows a step
held, recovered from its stacked batch."""

from __future__ import annotations

import torch

from harness.battery.pipeline_diagnosis import formula_reading, step_of
from harness.core.count_groups import count_group
from harness.core.fit import Block
from harness.core.mesh import Mesh
from harness.core.microbatch import Microbatch
from harness.distributed.pipeline import Pipeline, ScheduleStep, rows_of

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
