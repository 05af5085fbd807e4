"""The drawn-layout lane on real ranks: in the bf16 lane under both strategies (a step that enters autocast itself
passes, its mean of local means fails), with every check that applies (a wrong returned norm fails on clipping),
and starting with layouts on which the usual mistakes read apart (tests/unit/test_drawn_lanes.py has the plan)."""

from __future__ import annotations

import pytest
from hypothesis import find

import harness.battery.layouts as lay
from harness.battery.judge.verdict import FAIL, PASS
from harness.battery.layouts import drawn_verdict, informative_layouts, judge_layout, layouts
from harness.battery.plan.options import BatteryOptions

AUTOCAST = "user_recipes.autocast"


def _bf16(examples: int, worlds: str = "2") -> BatteryOptions:
    return BatteryOptions.parse(examples=examples, world_sizes=worlds, precision="bf16", strategy="both")


def test_a_step_that_enters_autocast_itself_passes_the_bf16_drawn_lane_and_its_mean_of_local_means_fails() -> None:
    """The first drawn layout, in bf16 under DDP: the correct autocast step passes, judged by the bound derived
    from its noise (not by float32 tolerances); the same step dividing by each rank's own count fails parity there
    and reads as a mean of local means (one launch each: the slow tier runs the whole lane)."""
    good = drawn_verdict(f"{AUTOCAST}:AutocastTokenMean", _bf16(1), derandomize=True, precision="bf16",
                         strategy="ddp")
    assert (PASS, "drawn (1 layouts, W in 2, bf16, ddp)") == (good.status, good.label), good.message
    assert "parity judged in bf16 on 1 of them" in good.message
    verdicts = judge_layout(f"{AUTOCAST}:AutocastMeanOfLocalMeans", informative_layouts((2,))[0], _bf16(1), "bf16",
                            "ddp")
    parity = next(v for v in verdicts if v.check == "parity")
    assert (FAIL, "numbers") == (parity.status, parity.cause), parity.message
    assert parity.diagnosis is not None and "mean_of_local_means" == parity.diagnosis["signature"]
    assert "the bound 4x that" in parity.message


@pytest.mark.slow  # two layouts at W in 2,3 and one failing launch, FSDP2 (the default tier shows DDP)
def test_the_bf16_drawn_lane_passes_the_autocast_step_and_rejects_its_mistake_under_fsdp2() -> None:
    """Under FSDP2, W in 2,3: the correct autocast step passes both chosen layouts; the mean of local means fails
    parity on the first."""
    good = drawn_verdict(f"{AUTOCAST}:AutocastTokenMean", _bf16(2, "2,3"), derandomize=True, precision="bf16",
                         strategy="fsdp2")
    assert (PASS, "drawn (2 layouts, W in 2,3, bf16, fsdp2)") == (good.status, good.label), good.message
    verdicts = judge_layout(f"{AUTOCAST}:AutocastMeanOfLocalMeans", informative_layouts((2, 3))[0], _bf16(2, "2,3"),
                            "bf16", "fsdp2")
    assert [FAIL] == [v.status for v in verdicts if v.check == "parity"]


@pytest.mark.slow  # three launches
def test_a_wrong_returned_norm_fails_the_drawn_lane_on_clipping_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that clips right but returns the sum of per-parameter norms fails the first drawn layout on the
    clipping check alone; judged by parity, one_sync and logged_loss only (the lane's old checks, the control) the
    lane passes it; the correct clipping recipe passes."""
    options = BatteryOptions.parse(examples=1, world_sizes="2", precision="fp32")
    verdicts = judge_layout("user_recipes.norms:SumOfTensorNorms", informative_layouts((2,))[0], options)
    assert ["clipping"] == [v.check for v in verdicts if v.status == FAIL]
    assert PASS == drawn_verdict("harness.recipes:clipped_global_token_mean", options, derandomize=True).status
    monkeypatch.setattr(lay, "DRAWN_CHECKS", ("parity", "one_sync", "logged_loss"))
    assert PASS == drawn_verdict("user_recipes.norms:SumOfTensorNorms", options, derandomize=True).status


@pytest.mark.slow  # eight launches
def test_the_first_drawn_layout_tells_weighting_mistakes_apart_where_hypothesis_s_simplest_cannot() -> None:
    """On the first chosen layout (W=3, counts that all differ) a mean of local means, a per-microbatch mean, a
    per-sequence mean and a missing world-size factor give four different readings, each weighting one named by
    itself; on Hypothesis's simplest layout (W=2, one supervised token, the control) every one that fails reads
    alike."""
    options = BatteryOptions.parse(world_sizes="2,3", precision="fp32")
    names = ("mean_of_local_means", "per_microbatch_mean", "per_sequence_mean", "no_world_size_factor")
    first = informative_layouts((2, 3))[0]
    simplest = find(layouts(world_sizes=(2, 3)), lambda layout: True)

    def readings(layout: lay.Layout) -> list[str | None]:
        out = []
        for name in names:
            parity = next(v for v in judge_layout(f"harness.recipes:{name}", layout, options) if v.check == "parity")
            out.append(None if parity.diagnosis is None else str(parity.diagnosis["signature"]))
        return out

    read = readings(first)
    assert list(names[:3]) == read[:3]
    assert len(names) == len(set(read))
    assert 1 == len({r for r in readings(simplest) if r is not None})
