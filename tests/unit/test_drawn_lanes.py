"""The drawn-layout lane's plan, without ranks: one row per precision lane and strategy, every check that applies,
first layouts on which mistakes read apart, a bf16 lane that says when it could judge nothing, and a diagnosis read on
the failing layout rather than on its shrunk copy (each judge here is a stand-in; tests/distributed/test_drawn_lane.py
launches the real ones)."""

from __future__ import annotations

import pytest
from hypothesis import find

import harness.battery.layouts as lay
from harness.battery.judge import registry
from harness.battery.judge.verdict import FAIL, NOT_APPLICABLE, PASS, Verdict
from harness.battery.layouts import DRAWN_CHECKS, Layout, drawn_verdicts, fits, informative_layouts, layouts
from harness.battery.plan import cases as plan
from harness.battery.plan.options import BatteryOptions
from harness.battery.prepare.probe.facts import ModelFacts

CORRECT = "harness.recipes:global_token_mean"


def _judge(seen: list[tuple[int, str, str]], *, status: str = PASS, fail_from: int | None = None,
           same_reading: bool = False) -> object:
    """A stand-in for :func:`harness.battery.layouts.judge_layout`: records (W, precision, strategy); parity gets
    ``status``, and fails with a diagnosis naming W on layouts of at least ``fail_from`` ranks (its signature one
    name at every W where ``same_reading``, its line naming W)."""

    def judge(recipe: str, layout: Layout, options: BatteryOptions, precision: str = "fp32",
              strategy: str | None = None, mesh: object = None) -> list[Verdict]:
        seen.append((layout.world_size, precision, strategy or "ddp"))
        if fail_from is not None and layout.world_size >= fail_from:
            return [Verdict("parity", recipe, "drawn", layout.world_size, precision, FAIL, "parity off",
                            cause="numbers", diagnosis={"signature": "one reading" if same_reading else
                                                        f"read at W={layout.world_size}",
                                                        "line": f"read at W={layout.world_size}"})]
        return [Verdict("parity", recipe, "drawn", layout.world_size, precision, status, "parity")]

    return judge


def test_the_drawn_lane_has_one_labelled_row_per_precision_lane_and_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    """--precision fp32,bf16 --strategy both: four drawn verdicts, each judged in its own lane and strategy and
    labelled with both."""
    seen: list[tuple[int, str, str]] = []
    monkeypatch.setattr(lay, "judge_layout", _judge(seen))
    options = BatteryOptions.parse(examples=2, world_sizes="2,3", precision="fp32,bf16", strategy="both")
    verdicts = drawn_verdicts(CORRECT, options, derandomize=True)
    assert [f"drawn (2 layouts, W in 2,3, {p}, {s})" for s in ("ddp", "fsdp2") for p in ("fp32", "bf16")] == [
        v.label for v in verdicts]
    assert [(p, s) for s in ("ddp", "fsdp2") for p in ("fp32", "bf16")] == [(v.precision, v.strategy)
                                                                             for v in verdicts]
    assert {(p, s) for s in ("ddp", "fsdp2") for p in ("fp32", "bf16")} == {(p, s) for _, p, s in seen}


def test_over_a_mesh_the_drawn_lane_draws_its_data_ranks_and_names_the_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    """--mesh dp=2,cp=2: one drawn row per mesh, every layout holding the mesh's 2 data ranks, labelled with the
    mesh; without --mesh the rows name the world sizes (the control above)."""
    seen: list[tuple[int, str, str]] = []
    monkeypatch.setattr(lay, "judge_layout", _judge(seen))
    options = BatteryOptions.parse(examples=2, precision="fp32", mesh=["dp=2,cp=2", "dp=3"])
    verdicts = drawn_verdicts(CORRECT, options, derandomize=True)
    assert ["drawn (2 layouts, mesh dp=2,cp=2, fp32, ddp)", "drawn (2 layouts, mesh dp=3, fp32, ddp)"] == [
        v.label for v in verdicts]
    assert {2, 3} == {w for w, _, _ in seen}
    assert ["drawn-fp32-ddp-dp2xcp2", "drawn-fp32-ddp-dp3"] == [lane.id for lane in plan.drawn_lanes(options)]


def test_no_drawn_lane_runs_with_a_budget_of_zero() -> None:
    """--battery-examples 0: no drawn row in any lane."""
    assert [] == plan.drawn_lanes(BatteryOptions.parse(examples=0, precision="bf16", strategy="both"))


@pytest.mark.parametrize(("examples", "precision", "strategy", "share"), [
    (12, "both", "ddp", 6), (12, "fp32", "ddp", 12), (12, "fp32,fp64,bf16", "both", 2), (3, "both", "ddp", 2),
    (1, "both", "ddp", 1), (13, "both", "ddp", 7)], ids=lambda v: str(v))
def test_the_drawn_budget_is_shared_over_the_lanes_with_at_least_the_chosen_layouts_each(
        examples: int, precision: str, strategy: str, share: int) -> None:
    """--battery-examples is the session's budget: each drawn row gets its share, rounded up, never fewer than the two
    layouts chosen to tell mistakes apart (nor more than the budget); one lane alone keeps it whole (the control)."""
    lanes = plan.drawn_lanes(BatteryOptions.parse(examples=examples, precision=precision, strategy=strategy))
    assert {share} == {lane.examples for lane in lanes}


def test_every_drawn_layout_is_judged_by_every_check_that_runs_on_a_window_with_tokens() -> None:
    """The drawn checks are the registry's (clipping included); only the empty-window check, whose windows hold no
    token, is left to the all_empty scenario."""
    assert tuple(n for n in registry.REGISTRY if n != "empty_window") == DRAWN_CHECKS
    assert "clipping" in DRAWN_CHECKS


@pytest.mark.parametrize("worlds", [(1, 2, 3, 4), (2,), (2, 3), (1,)], ids=lambda w: "w" + "".join(map(str, w)))
def test_the_first_drawn_layout_holds_the_largest_world_and_counts_that_all_differ(worlds: tuple[int, ...]) -> None:
    """The first layout has the largest chosen world size, ranks whose totals differ, and several microbatches per
    rank whose counts differ: the shapes on which a mean of local means, a missing world-size factor and a
    per-microbatch mean give different gradients."""
    first = informative_layouts(worlds)[0]
    counts = first.counts()[0]
    assert max(worlds) == first.world_size
    assert len(counts) == len({sum(rank) for rank in counts})
    assert all(len(rank) >= 3 and len(rank) == len(set(rank)) for rank in counts)


def test_hypothesis_s_own_first_layout_is_the_degenerate_one_the_chosen_layouts_replace() -> None:
    """The control: the simplest layout Hypothesis draws first at W in 2,3 holds one microbatch per rank and equal
    counts, so every weighting of ranks or microbatches gives one gradient there."""
    simplest = find(layouts(world_sizes=(2, 3)), lambda layout: True)
    counts = simplest.counts()[0]
    assert 2 == simplest.world_size
    assert [[1], [1]] == counts or any(len(rank) == 1 for rank in counts)
    assert 1 == len({sum(rank) for rank in counts if sum(rank)})


def test_the_chosen_layouts_fit_a_model_that_takes_short_rows_only() -> None:
    """A model of at most 8 positions, two values per channel: the chosen layouts are cut to shapes it runs."""
    facts = ModelFacts(None, "harness", min_positions=2, max_len=8)
    assert all(fits(layout, facts) for layout in informative_layouts((1, 2, 3, 4), facts))


def test_a_bf16_lane_that_could_judge_parity_on_no_layout_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layout's parity n/a in bf16 (too balanced for the bound): the drawn verdict is n/a and says why,
    not a pass that judged nothing."""
    monkeypatch.setattr(lay, "judge_layout", _judge([], status=NOT_APPLICABLE))
    (verdict,) = drawn_verdicts(CORRECT, BatteryOptions.parse(examples=3, world_sizes="2", precision="bf16"),
                                derandomize=True)
    assert NOT_APPLICABLE == verdict.status
    assert "parity could be judged on none of them in bf16" in verdict.message


def test_a_failing_drawn_verdict_reads_its_diagnosis_on_the_failing_layout_not_the_shrunk_one(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layout that fails at W=4 shrinks to W=3 (the same reading there); the verdict's diagnosis is the W=4
    layout's, and both are shown."""
    monkeypatch.setattr(lay, "judge_layout", _judge([], fail_from=2, same_reading=True))
    (verdict,) = drawn_verdicts(CORRECT, BatteryOptions.parse(examples=1, world_sizes="3,4", precision="fp32"),
                                derandomize=True)
    assert (FAIL, "read at W=4") == (verdict.status, verdict.diagnosis["line"] if verdict.diagnosis else None)
    assert "a drawn layout at W=4 fails parity" in verdict.message
    assert "shrunk (" in verdict.message and "Layout(world_size=3" in verdict.message


def test_a_smaller_layout_that_fails_with_another_reading_is_not_taken_by_the_shrinker(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every smaller layout fails too, but W=3 reads otherwise (a worse witness of another mistake): the shrunk
    layout keeps W=4, where the reading holds (the test above is the control: the same reading at W=3 shrinks
    to it)."""
    monkeypatch.setattr(lay, "judge_layout", _judge([], fail_from=2))
    (verdict,) = drawn_verdicts(CORRECT, BatteryOptions.parse(examples=1, world_sizes="3,4", precision="fp32"),
                                derandomize=True)
    assert (FAIL, "read at W=4") == (verdict.status, verdict.diagnosis["signature"] if verdict.diagnosis else None)
    assert "shrunk (" in verdict.message and "Layout(world_size=3" not in verdict.message
