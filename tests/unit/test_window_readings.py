"""A scale, a per-row weighting and a residue named by what the window holds: the fact search
(``harness.diagnosis.window_facts``), the rows' token weights (``harness.diagnosis.row_weights``), and when a residue is
rounding (``harness.diagnosis.ranks``). Pure arithmetic on hand-made windows: no scenario's numbers."""

from __future__ import annotations

import torch
from support.evidence import TinyConvention

from harness.core.mesh import Mesh
from harness.core.microbatch import Microbatch
from harness.core.objectives import Objective
from harness.diagnosis import window_facts as wf
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.factor_names import name_factor
from harness.diagnosis.fit import Block, Fit, match_tolerance
from harness.diagnosis.objective import _aux_factor
from harness.diagnosis.ranks import BF16_UNIT, rounding_only
from harness.diagnosis.row_weights import read_rows
from harness.diagnosis.signatures import scale_tolerance


def _blocks(counts: list[list[int]], rows: int = 2) -> list[Block]:
    return [Block(r, m, t, rows=rows) for r, rank in enumerate(counts) for m, t in enumerate(rank)]


def _bf16(x: float) -> float:
    return float(torch.tensor(float(x)).to(torch.bfloat16).double())


# Counts chosen so that N (1157) rounds in bfloat16 (to 1160) and in no other fact of the window.
WINDOW = _blocks([[131, 178], [402, 446]], rows=3)
N = 1157


def _read(c: float, blocks: list[Block] = WINDOW, world: int = 2, tolerance: float = 1e-6) -> str:
    return name_factor(c, blocks, world, tolerance=tolerance)


def test_a_count_rounded_to_bf16_is_named_as_that_rounding() -> None:
    """N / round_bf16(N) reads the bf16 rounding, never "no token count"; its control, a scale 3e-4 away, reads no
    count."""
    assert 1160.0 == _bf16(N)
    words = _read(N / _bf16(N))
    assert words.startswith("the loss was normalized by N rounded to bfloat16 (1160 tokens"), words
    assert "no token count" not in words
    assert "no token count of this window" in _read(1 + 3e-4)


def test_a_count_one_too_large_is_named_n_plus_one() -> None:
    words = _read(N / (N + 1))
    assert words.startswith("the loss was normalized by N plus one (1158 tokens"), words


def test_an_unnormalized_sum_is_named_with_its_factors() -> None:
    """N/W (each rank's sum, averaged by DDP) and N/(W*k) (each microbatch's sum over k) both read as an unnormalized
    loss sum; the right scale (the control) reads as none of them."""
    three = _blocks([[131, 178], [402, 446], [90, 95]])
    n3 = sum(b.tokens for b in three)
    by_w = _read(n3 / 3, blocks=three, world=3)
    assert by_w.startswith("the loss was never divided by a token count (an unnormalized loss sum): each rank's loss "
                           "sum backpropagated as it is, then averaged over the W ranks by DDP"), by_w
    by_k = _read(n3 / 6, blocks=three, world=3)
    assert "unnormalized loss sum): each microbatch's loss sum divided by the microbatch count k" in by_k, by_k
    assert not wf.search(1.0, three, 3, 1e-6)


def test_w_times_one_ranks_own_count_and_n_divided_twice_are_named() -> None:
    """N / (W * n_0): one rank's count for the window's, times W; W/N: the count divided twice."""
    words = _read(N / (2 * 309))
    assert words.startswith("the loss was normalized by rank 0's local count (309 tokens)") and (
        "world-size factor is missing" in words), words
    assert _read(2 / N).startswith("the loss was divided by N twice"), _read(2 / N)


def test_equal_counts_are_named_together_and_the_simplest_leads() -> None:
    """round_bf16(N) = N + 1 here (N = 1247): both readings are given, the vocabulary's first leading; where the
    bf16 count equals k times one microbatch's count (a three-factor reading), the two-factor bf16 reading is the
    one given."""
    tied = _blocks([[120, 130], [400, 597]])
    words = _read(1247 / 1248, blocks=tied)
    assert words.startswith("the loss was normalized by N plus one") and "round_bf16(N)" in words, words
    assert "cannot tell those causes apart" in words
    half = _blocks([[300, 500], [212, 14]])  # N = 1026, round_bf16(N) = 1024 = k x microbatch 0's count (512)
    assert 1024.0 == _bf16(1026)
    lead = _read(1026 / 1024, blocks=half)
    assert lead.startswith("the loss was normalized by N rounded to bfloat16"), lead
    assert "estimated from one microbatch" not in lead


def test_the_search_tolerance_comes_from_the_fit() -> None:
    """A scale 2e-5 off N/(N+1) is named when the ratios scatter by 1e-5 (a noisy fit), not when they sit within
    1e-8 (a precise one)."""
    c = N / (N + 1) * (1 + 2e-5)
    fit = Fit(torch.zeros(4, dtype=torch.float64), 1e-9, 1.0)
    noisy = scale_tolerance([c * (1 + 1e-5), c * (1 - 1e-5), c, c], c, fit, "fp64")
    precise = scale_tolerance([c * (1 + 1e-8), c, c, c], c, fit, "fp64")
    assert "N plus one" in _read(c, tolerance=noisy)
    assert "no token count of this window" in _read(c, tolerance=precise)
    assert match_tolerance() >= noisy > precise


def test_the_search_does_not_run_at_the_bf16_lanes_accuracy() -> None:
    """At 1e-2 a value lies near several expressions by chance: the search names none."""
    assert not wf.search(N / (N + 1), WINDOW, 2, 1e-2)


def test_the_facts_come_from_the_blocks() -> None:
    """The vocabulary is the window's own counts: each rank's count and rows, the bf16 and fp16 roundings of N."""
    facts = {f.symbol: f.value for f in wf.window_facts(WINDOW, 2)}
    assert 309 == facts["n_0"] and 848 == facts["n_1"] and 6 == facts["rows_0"]
    assert 1160.0 == facts["round_bf16(N)"] and 1158 == facts["(N+1)"]
    assert N not in facts.values()


def _rows(counts: list[list[list[int]]]) -> list[Block]:
    return [Block(r, m, t, row=i) for r, rank in enumerate(counts) for m, mb in enumerate(rank)
            for i, t in enumerate(mb)]


ROWS = _rows([[[12, 40], [7, 30, 9]], [[50, 61], [22, 5, 80]]])


def test_a_token_mean_per_microbatch_is_read_off_the_rows() -> None:
    """Each row's tokens weigh 1/(W k n_rm): a token mean over each microbatch, under whichever objective."""
    per_mb: dict[tuple[int, int], int] = {}
    for b in ROWS:
        per_mb[(b.rank, b.microbatch)] = per_mb.get((b.rank, b.microbatch), 0) + b.tokens
    weights = [1 / (2 * 2 * per_mb[(b.rank, b.microbatch)]) for b in ROWS]
    sig = read_rows(ROWS, weights, 2, 2, 1.9e-7, "sequence_mean is the sequence mean")
    assert sig is not None and "per_microbatch_mean" == sig.name, sig
    assert sig.sentence.startswith("a token mean over each microbatch: every token weighs 1/(W * k * its token "
                                   "count); the per-sequence view fits it (residual 1.9e-07)"), sig.sentence


def test_a_token_mean_per_rank_reads_a_mean_of_local_means_and_the_sequence_mean_reads_none() -> None:
    per_rank: dict[int, int] = {}
    for b in ROWS:
        per_rank[b.rank] = per_rank.get(b.rank, 0) + b.tokens
    sig = read_rows(ROWS, [1 / (2 * per_rank[b.rank]) for b in ROWS], 2, 2, 1e-7, "")
    assert sig is not None and "mean_of_local_means" == sig.name, sig
    # The control: the window's sequence mean is the declared objective's own reading, not a row mistake.
    assert read_rows(ROWS, [1 / (b.tokens * len(ROWS)) for b in ROWS], 2, 2, 1e-7, "") is None


def test_a_residue_is_rounding_only_when_the_weights_are_right_and_it_is_one_rounding() -> None:
    """8.5e-4 with weights within 1.4e-3 (logits cast to bf16) is rounding; tokens re-weighted by a few percent
    (weights 4.6e-3 off, residual 2e-2) is not, nor a block re-weighting (float32 residual, weights 7% off)."""
    assert rounding_only([1.0014, 0.999, 1.0], 8.5e-4)
    assert not rounding_only([1.0046, 0.997, 1.0], 2.0e-2)
    assert not rounding_only([1.07, 0.93, 1.0], 1e-7)
    assert not rounding_only([1.0, 1.0], 1e-7)
    assert BF16_UNIT == 2.0**-8


def test_an_auxiliary_factor_is_named_as_a_product_of_w_and_k() -> None:
    assert _aux_factor(6.0, 3, 2).startswith("a factor W*k = 6 (W=3, k=2): multiplied by W like the main loss")
    assert "a factor no count of this window names" == _aux_factor(1.37, 3, 2)


def _aux_run(shape: str, unit: str = "microbatch") -> Evidence:
    """Evidence by hand: two microbatches on every data coordinate of the mesh, an auxiliary term of ``unit``."""
    mesh = Mesh.parse(shape)
    mb = Microbatch(torch.ones(1, 4, dtype=torch.long), torch.tensor([[1, 2, -100, 3]]))
    windows = [[[mb, mb] for _ in range(mesh.data_ranks)]]  # two microbatches on every data coordinate
    return Evidence(windows, None, TinyConvention(), mesh, objective=Objective(auxiliary_unit=unit),
                    recipe="pkg.mod:aux", scenario="uneven")


def test_a_per_microbatch_term_weighing_cp_times_its_right_weight_on_a_mesh_is_named_by_cp() -> None:
    """At dp=2,cp=2 (D = 4 microbatches), every auxiliary weight 2/D reads as scaled for the token group where dp
    belongs, naming cp's size; 4/D (the token group's size T) reads as summed over the ranks, with T."""
    from harness.diagnosis.objective import auxiliary_reading

    run = _aux_run("dp=2,cp=2")
    cp = auxiliary_reading(run, 0, torch.full((4,), 2 / 4, dtype=torch.float64))  # type: ignore[arg-type]
    assert cp is not None and "auxiliary_misweighted" == cp.name
    assert "cp's size (2)" in cp.sentence and "token group (dp x cp, 4 ranks)" in cp.sentence, cp.sentence
    summed = auxiliary_reading(run, 0, torch.full((4,), 4 / 4, dtype=torch.float64))  # type: ignore[arg-type]
    assert summed is not None and "auxiliary_summed_over_ranks" == summed.name
    assert "T=4" in summed.sentence, summed.sentence
    assert auxiliary_reading(run, 0, torch.full((4,), 1 / 4, dtype=torch.float64)) is None  # type: ignore[arg-type]


def test_a_factor_of_two_on_dp_only_reads_as_summed_over_its_two_ranks() -> None:
    """Its control: without cp, the same factor 2 at dp=2 is W (the term summed over the ranks), never cp's."""
    from harness.diagnosis.objective import auxiliary_reading

    sig = auxiliary_reading(_aux_run("dp=2"), 0, torch.full((4,), 2 / 4, dtype=torch.float64))  # type: ignore[arg-type]
    assert sig is not None and "auxiliary_summed_over_ranks" == sig.name
    assert "W=2" in sig.sentence and "cp" not in sig.sentence, sig.sentence
