"""The recipe-level diagnosis (harness.diagnosis.recipe_level, read from the battery's verdicts by
harness.battery.report.recipe_cause): one cause for every failing case, or the cases that disagree and why.

The cases are built from real weights: the blocks' counts of a window, the weights a mistake gives them, and the
patterns' fits computed on them (:func:`pattern_fits`), as the diagnosis computes them on a run."""

from __future__ import annotations

import math

import torch

from harness.battery.judge.verdict import FAIL, Verdict
from harness.battery.report.recipe_cause import CLIP, names_its_cause, readings
from harness.battery.report.summary import format_summary
from harness.diagnosis.fit import Block, Fit
from harness.diagnosis.positions import FIX, POSITION, position_profile
from harness.diagnosis.recipe_level import pattern_fits

UNEVEN = [Block(0, 0, 30), Block(0, 1, 10), Block(1, 0, 5), Block(1, 1, 3)]
SINGLE = [Block(0, 0, 40), Block(0, 1, 0), Block(1, 0, 0), Block(1, 1, 0)]


def _local_means(blocks: list[Block], world: int = 2) -> Fit:
    per_rank: dict[int, int] = {}
    for b in blocks:
        per_rank[b.rank] = per_rank.get(b.rank, 0) + b.tokens
    w = [1 / (world * per_rank[b.rank]) if b.tokens else math.nan for b in blocks]
    return Fit(torch.tensor(w, dtype=torch.float64), 1e-9, 1.0)


def _scaled(blocks: list[Block], c: float) -> Fit:
    n = sum(b.tokens for b in blocks)
    return Fit(torch.tensor([c / n if b.tokens else math.nan for b in blocks], dtype=torch.float64), 1e-9, 1.0)


def _verdict(check: str, scenario: str, signature: str | None = None, fit: Fit | None = None,
             blocks: list[Block] | None = None, world: int = 2, cause: str = "numbers", finding: str | None = None,
             alternatives: tuple[str, ...] = (), recipe: str = "pkg:recipe") -> Verdict:
    diagnosis = None
    if signature is not None:
        fits = pattern_fits(blocks or [], fit, world) if fit is not None else ()
        diagnosis = {"signature": signature, "sentence": f"the {signature} sentence", "fix": f"the {signature} fix",
                     "alternatives": list(alternatives), "fits": [list(f) for f in fits]}
    return Verdict(check, recipe, scenario, world, "fp32", FAIL, f"check {check} FAILED: recipe r, {scenario}: x",
                   cause=cause, finding=finding, diagnosis=diagnosis)


def test_a_case_whose_counts_show_the_mistake_as_a_scale_is_read_with_the_others_as_one_cause() -> None:
    """On ``single`` one rank holds every token: a mean of local means IS a common scale there (1/W), and the case
    reads global_scale; its weights fit the mean of local means' prediction at scale 1, so the recipe has one cause."""
    cases = [_verdict("parity", "uneven", "mean_of_local_means", _local_means(UNEVEN), UNEVEN),
             _verdict("parity", "single", "global_scale", _local_means(SINGLE), SINGLE)]
    read = readings(cases)["pkg:recipe"]
    assert read.cause == "mean_of_local_means"
    assert "one cause explains all 2 failing cases" in read.lines()[0]
    assert read.lines()[-1] == "  fix: the mean_of_local_means fix"


def test_a_case_whose_weights_miss_the_prediction_disagrees_and_says_by_how_much() -> None:
    """The negative control: the same single case at a scale 1/W does not fit, but at 3/4 it fits no mean of local
    means: no one cause, and the disagreeing case is named with its measured miss."""
    cases = [_verdict("parity", "uneven", "mean_of_local_means", _local_means(UNEVEN), UNEVEN),
             _verdict("parity", "uneven", "mean_of_local_means", _local_means(UNEVEN), UNEVEN, world=3),
             _verdict("parity", "single", "global_scale", _scaled(SINGLE, 0.75), SINGLE)]
    read = readings(cases)["pkg:recipe"]
    assert read.cause is None and read.lead == "mean_of_local_means"
    lines = read.lines()
    assert "no one cause explains every failing case; mean_of_local_means explains 2 of 3" in lines[0]
    assert "1 disagrees, reading global_scale" in lines[2] and "prediction by" in lines[2], lines


def test_a_weighting_that_misses_the_pattern_is_measured() -> None:
    uneven = _local_means(UNEVEN)
    off = Fit(uneven.weights * torch.tensor([1.0, 1.3, 1.0, 1.0], dtype=torch.float64), 1e-9, 1.0)
    cases = [_verdict("parity", "uneven", "mean_of_local_means", uneven, UNEVEN),
             _verdict("parity", "varying", "unexplained", off, UNEVEN)]
    lines = readings(cases)["pkg:recipe"].lines()
    assert "their weights miss mean_of_local_means's prediction by" in lines[2], lines


def test_a_check_without_a_reading_of_its_own_is_a_consequence_that_never_decides() -> None:
    cases = [_verdict("parity", "uneven", "mean_of_local_means", _local_means(UNEVEN), UNEVEN),
             _verdict("logged_loss", "uneven"), _verdict("logged_loss", "single")]
    read = readings(cases)["pkg:recipe"]
    assert read.cause == "mean_of_local_means"
    assert any("also failing, as its consequence (logged_loss in 2)" in line for line in read.lines())


def test_a_recipe_failing_only_a_comparison_is_read_by_that_check() -> None:
    read = readings([_verdict("one_sync", "uneven"), _verdict("one_sync", "single")])["pkg:recipe"]
    assert read.cause == "one_sync numbers"


def test_a_failed_run_counts_once_whatever_checks_it_fails() -> None:
    """A desync fails every check of its run the same way: one case, which disagrees with a weighting elsewhere (on
    long, where no count is zero)."""
    desync = [_verdict(check, "long", cause="desync") for check in ("parity", "one_sync", "ranks_agree")]
    read = readings([_verdict("parity", "uneven", "mean_of_local_means", _local_means(UNEVEN), UNEVEN), *desync])
    lines = read["pkg:recipe"].lines()
    assert "1 disagrees, reading desync" in lines[2] and "another kind than a weighting" in lines[2], lines


def test_a_drawn_layout_narrows_and_never_contradicts() -> None:
    base = [_verdict("parity", "single", "global_scale", _local_means(SINGLE), SINGLE, alternatives=("dropped",))]
    both = readings(base)["pkg:recipe"]
    assert both.cause == "mean_of_local_means" or "mean_of_local_means" in both.also
    narrowed = readings([*base, _verdict("parity", "drawn", "mean_of_local_means", _local_means(UNEVEN), UNEVEN)])
    assert narrowed["pkg:recipe"].cause == "mean_of_local_means"
    other = readings([*base, _verdict("parity", "drawn", "other_objective")])["pkg:recipe"]
    assert other.cause == both.cause
    assert any("the drawn layouts read other_objective" in line for line in other.lines())


def test_a_clip_and_the_parity_it_moved_are_one_mistake_seen_by_two_checks() -> None:
    """Parity reads unexplained where the clipping check names the norm, and clipping_not_applied where the clip
    check only fails its comparison: the clip is the shared cause; without the link they would disagree."""
    cases = [_verdict("parity", "uneven", "unexplained"), _verdict("clipping", "uneven", finding="pre_sync_norm"),
             _verdict("parity", "single", "clipping_not_applied"), _verdict("clipping", "single")]
    read = readings(cases)["pkg:recipe"]
    assert read.cause == CLIP
    assert readings(cases[:1] + cases[2:3])["pkg:recipe"].cause is None


def test_the_last_screen_leads_with_the_recipe_level_reading() -> None:
    cases = [_verdict("parity", "uneven", "mean_of_local_means", _local_means(UNEVEN), UNEVEN),
             _verdict("parity", "single", "global_scale", _local_means(SINGLE), SINGLE)]
    screen = format_summary(cases).splitlines()
    assert screen[0].startswith("recipe-level diagnosis (mean_of_local_means): one cause explains all 2")
    assert screen.index("failing checks, grouped by cause (2 case(s) in 2 group(s)):") > 0


def test_pattern_fits_name_the_scale_of_a_right_shape_as_global_scale() -> None:
    fits = {name: (c, dev) for name, c, dev in pattern_fits(UNEVEN, _scaled(UNEVEN, 0.5), 2)}
    assert fits["global_scale"][1] < 1 and fits["correct"][0] == 0.5 and fits["correct"][1] > 1
    assert fits["mean_of_local_means"][1] > 1  # its shape does not fit a uniform scale on uneven counts
    assert pattern_fits(UNEVEN, Fit(_scaled(UNEVEN, 1).weights, 0.5, 1.0), 2) == ()  # a fit that explains too little


def _weights(ratios: dict[tuple[int, int], float | None]) -> list[dict[str, object]]:
    return [{"rank": r, "microbatch": m, "tokens": 0 if q is None else 10, "ratio": q} for (r, m), q in ratios.items()]


def _positional(scenario: str, signature: str, ratios: dict[tuple[int, int], float | None]) -> Verdict:
    v = _verdict("parity", scenario, signature)
    assert v.diagnosis is not None
    v.diagnosis["weights"] = _weights(ratios)
    return v


LONG = {(0, 0): 1.0, (0, 1): 0.0, (0, 2): 0.0, (0, 3): 1.0, (1, 0): 1.0, (1, 1): 0.0, (1, 2): 1.0}
"""A loop over a window's first and last microbatch: each rank's middle ones dropped (rank 1 has three)."""


def test_a_loop_written_for_one_window_shape_is_one_cause_by_position() -> None:
    """Dropped middles on a long window, the only microbatch counted twice on a one-microbatch window: neither case's
    reading is the other's, and the position of each microbatch in its rank's window explains both."""
    cases = [_positional("long", "dropped", LONG), _positional("single", "global_scale", {(0, 0): 2.0, (1, 0): 2.0})]
    read = readings(cases)["pkg:recipe"]
    assert read.cause == POSITION
    lines = read.lines()
    assert "read on their own windows as dropped in 1, global_scale in 1" in lines[0]
    said = "the window's first microbatch 1x, each middle one 0x, its last 1x, a window's only microbatch 2x"
    assert said in lines[1]
    assert lines[-1] == f"  fix: {FIX}"


def test_positions_that_disagree_or_one_scale_on_every_position_name_no_position() -> None:
    """The negative controls: a middle microbatch kept in one case and dropped in another disagrees; and a common scale
    on every position (every weight 0.5) is a global scale, not a position."""
    kept = {**LONG, (0, 1): 1.0, (0, 2): 1.0, (1, 1): 1.0}
    assert readings([_positional("long", "dropped", LONG), _positional("uneven", "block_scaled", kept)]
                    )["pkg:recipe"].cause is None
    halves = [_positional("uneven", "global_scale", {(0, 0): 0.5, (0, 1): 0.5, (1, 0): 0.5}),
              _positional("single", "global_scale", {(0, 0): 0.5, (1, 0): 0.5})]
    assert readings(halves)["pkg:recipe"].cause == "global_scale"
    weighted = [_positional("uneven", "mean_of_local_means", {(0, 0): 0.7, (0, 1): 0.7, (1, 0): 1.6, (1, 1): 1.6})]
    assert position_profile(weighted[0].diagnosis["weights"]) is None  # type: ignore[index,arg-type]


def test_a_window_whose_shape_makes_two_readings_one_reads_as_either() -> None:
    """Every rank with one microbatch: a mean per microbatch is a mean per rank; one rank holding every token: a factor
    per rank is a common scale. The negative control: with two microbatches a rank, the two stay apart."""
    one_each = {(0, 0): 0.7, (1, 0): 1.6}
    pmm = [_positional("uneven", "per_microbatch_mean", {(0, 0): 0.5, (0, 1): 1.5, (1, 0): 1.2}),
           _positional("single", "mean_of_local_means", one_each)]
    assert readings(pmm)["pkg:recipe"].cause == "per_microbatch_mean"
    two_each = {(0, 0): 0.7, (0, 1): 0.7, (1, 0): 1.6, (1, 1): 1.6}
    apart = [pmm[0], _positional("uneven", "mean_of_local_means", two_each)]
    assert readings(apart)["pkg:recipe"].cause is None
    lone = [_positional("uneven", "per_rank_normalizer", {(0, 0): 0.7, (1, 0): 1.6}),
            _positional("one_empty", "global_scale", {(0, 0): 0.5, (1, 0): None})]
    assert readings(lone)["pkg:recipe"].cause == "per_rank_normalizer"
    both = [lone[0], _positional("one_empty", "global_scale", {(0, 0): 0.5, (1, 0): 0.5})]
    assert readings(both)["pkg:recipe"].cause is None


def test_a_mean_per_microbatch_is_one_with_a_re_split_s_micro_batch_mean_where_a_case_reads_the_re_split() -> None:
    """A recipe that re-splits by a token budget reads dynamic_microbatch_mean where its split differs from the
    window's microbatches, and per_microbatch_mean where it falls on them: one cause. The negative control: without a
    case reading the re-split, a mean per microbatch and a mean per rank on two microbatches a rank stay apart."""
    two_each = {(0, 0): 0.7, (0, 1): 0.7, (1, 0): 1.6, (1, 1): 1.6}
    split = [_positional("token_budget", "dynamic_microbatch_mean", {(0, 0): 0.5, (0, 1): 1.5, (1, 0): 1.2}),
             _positional("uneven", "per_microbatch_mean", {(0, 0): 0.5, (0, 1): 1.5, (1, 0): 1.2}),
             _positional("long", "mean_of_local_means", two_each)]
    read = readings(split)["pkg:recipe"]
    assert "dynamic_microbatch_mean" == read.cause and () == read.also
    apart = split[1:]
    assert readings(apart)["pkg:recipe"].cause is None


def test_an_auxiliary_factor_w_times_k_and_a_term_summed_over_ranks_are_one_where_every_rank_has_one_microbatch(
        ) -> None:
    """An auxiliary term never divided by k and multiplied by W reads W*k on two microbatches a rank and W on one:
    both cases name one cause. The negative control: summed over ranks on two microbatches a rank stays apart."""
    misweighted = _positional("uneven", "auxiliary_misweighted", {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 1.0})
    single = _positional("single", "auxiliary_summed_over_ranks", {(0, 0): 1.0, (1, 0): 1.0})
    assert "auxiliary_misweighted" == readings([misweighted, single])["pkg:recipe"].cause
    two_each = _positional("uneven", "auxiliary_summed_over_ranks",
                           {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 1.0})
    assert readings([misweighted, two_each])["pkg:recipe"].cause is None


def test_an_auxiliary_factor_w_times_k_and_a_term_never_divided_by_k_are_one_where_the_window_has_one_rank(
        ) -> None:
    """At W=1 a router term multiplied by W and never divided by k weighs k: both readings name one cause. The
    negative control: the same reading on two ranks stays apart."""
    misweighted = _positional("uneven", "auxiliary_misweighted", {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 1.0})
    one_rank = _positional("uneven", "auxiliary_not_divided_by_k", {(0, 0): 1.0, (0, 1): 1.0})
    assert "auxiliary_misweighted" == readings([misweighted, one_rank])["pkg:recipe"].cause
    two_ranks = _positional("uneven", "auxiliary_not_divided_by_k", {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 1.0})
    assert readings([misweighted, two_ranks])["pkg:recipe"].cause is None


def test_a_control_names_its_cause_only_when_the_recipe_level_reads_it() -> None:
    """The catalog test's rule, with its negative controls: another cause, and no one cause, do not name it."""
    molm = [_verdict("parity", "uneven", "mean_of_local_means", _local_means(UNEVEN), UNEVEN),
            _verdict("parity", "single", "global_scale", _local_means(SINGLE), SINGLE)]
    read = readings(molm)["pkg:recipe"]
    assert names_its_cause(read, "mean_of_local_means", "parity")
    assert not names_its_cause(read, "per_microbatch_mean", "parity")  # no case reads it: parity numbers expected
    split = readings([molm[0], _verdict("parity", "single", "global_scale", _scaled(SINGLE, 0.75), SINGLE)])
    assert not names_its_cause(split["pkg:recipe"], "mean_of_local_means", "parity")
    sync = readings([_verdict("one_sync", "uneven"), _verdict("one_sync", "single")])["pkg:recipe"]
    assert names_its_cause(sync, None, "one_sync") and not names_its_cause(sync, None, "empty_window")
    # Two checks failing their comparisons, neither with a reading: nothing tells which is the cause.
    two = readings([_verdict("one_sync", "uneven"), _verdict("logged_loss", "uneven")])["pkg:recipe"]
    assert two.cause is None and not names_its_cause(two, None, "one_sync")


def test_a_failed_run_where_a_local_count_is_zero_is_one_more_view_of_that_count() -> None:
    """On one_empty a rank holds no token: a recipe dividing by its own count meets a zero there, and a desync there
    is that count's; on uneven no count is zero, and the same desync disagrees (the negative control)."""
    molm = _verdict("parity", "uneven", "mean_of_local_means", _local_means(UNEVEN), UNEVEN)
    read = readings([molm, _verdict("parity", "one_empty", cause="desync")])["pkg:recipe"]
    assert read.cause == "mean_of_local_means"
    assert any("the desync on one_empty: a rank, microbatch or shard holds no supervised token" in line
               for line in read.lines())
    assert readings([molm, _verdict("parity", "uneven", cause="desync", world=3)])["pkg:recipe"].cause is None
    alone = readings([_verdict("parity", "one_empty", cause="desync")])["pkg:recipe"]
    assert alone.cause == "desync" and alone.also == ()  # the local counts it allows are never named beside it


def test_the_cases_where_a_local_count_is_zero_are_read_off_the_scenarios_windows() -> None:
    from harness.battery.report.zero_counts import local_count_is_zero

    zero = {"sparse", "one_empty", "all_empty"}
    for scenario in ("uneven", "single", "long", "varying", *zero):
        assert local_count_is_zero(scenario, 2) == (scenario in zero), scenario
    assert local_count_is_zero("empty_shard", 4, "dp=2,cp=2")  # a cp chunk without a token
    assert local_count_is_zero("one_token", 4, "dp=2,cp=2")
    assert not local_count_is_zero("cp_balanced", 4, "dp=2,cp=2")
    assert not local_count_is_zero("drawn", 2)  # not a scenario it can build


def test_a_window_started_elsewhere_is_an_earlier_windows_consequence() -> None:
    cases = [_verdict("parity", "uneven", "mean_of_local_means", _local_means(UNEVEN), UNEVEN),
             _verdict("parity", "varying", "started_elsewhere")]
    read = readings(cases)["pkg:recipe"]
    assert read.cause == "mean_of_local_means"
    assert any("windows read at weights an earlier window's wrong step moved" in line for line in read.lines())


def test_a_gradient_through_an_engaged_clip_that_no_weighting_explains_is_a_view_of_the_clip() -> None:
    """Unexplained where the reference's clip engaged, clipping_not_applied elsewhere: one wrong clip. The negative
    control: the same unexplained case where no clip engaged stays apart."""
    through = _verdict("parity", "uneven", "unexplained")
    assert through.diagnosis is not None
    through.diagnosis["clipped"] = True
    apart = _verdict("parity", "uneven", "unexplained", world=3)
    single = _verdict("parity", "single", "clipping_not_applied")
    assert readings([through, single])["pkg:recipe"].cause == CLIP
    assert readings([apart, single])["pkg:recipe"].cause is None


def test_a_bf16_case_that_names_nothing_does_not_decide() -> None:
    """The bf16 lane reads weights to its bound: a count off by a rounding (0.3%) reads unexplained there and a scale
    in fp32. The negative control: the same unexplained case in fp32 disagrees."""
    scale = _verdict("parity", "uneven", "global_scale", _scaled(UNEVEN, 0.997), UNEVEN)
    coarse = _verdict("parity", "uneven", "unexplained", world=3)
    bf16 = Verdict(coarse.check, coarse.recipe, coarse.scenario, 3, "bf16", FAIL, coarse.message,
                   diagnosis=coarse.diagnosis, cause="numbers")
    read = readings([scale, bf16])["pkg:recipe"]
    assert read.cause == "global_scale"
    assert any("read to the bf16 lane's bound" in line for line in read.lines())
    assert readings([scale, coarse])["pkg:recipe"].cause is None
