"""Shrinking keeps the reading honest, on the real control: a mean per microbatch on the first chosen layout reads
per_microbatch_mean; shrunk to one rank of one-row microbatches its counts cannot tell it from the sequence mean, and
the verdict says so instead of advising --objective=sequence_mean (tests/unit/test_witness.py holds the rule)."""

from __future__ import annotations

import dataclasses

from harness.battery.judge.verdict import FAIL
from harness.battery.judge.witness import keeps_reading, reading_key, shrunk_note
from harness.battery.layouts import Layout, drawn_verdict, informative_layouts, judge_layout
from harness.battery.plan.options import BatteryOptions
from harness.diagnosis.fixes import fix_for

CONTROL = "harness.recipes:per_microbatch_mean"
OPTIONS = BatteryOptions.parse(examples=1, world_sizes="1,2,3,4", precision="fp32")


def one_rank_of_one_row_microbatches() -> tuple[Layout, Layout]:
    """The first chosen layout at W=4 (rank 0 holds [5, 17, 11] supervised tokens) and what the shrinker reached
    from it before it kept the reading: rank 0's last two microbatches, one row each ([7, 11])."""
    big = informative_layouts((1, 2, 3, 4))[0]
    (rank0,) = [big.windows[0][0]]
    small = dataclasses.replace(big, world_size=1, windows=((tuple(rows[:1] for rows in rank0[1:]),),))
    return big, small


def test_a_shrunk_layout_that_cannot_tell_a_mean_per_microbatch_from_the_sequence_mean_says_so() -> None:
    """At W=4 parity reads per_microbatch_mean with its fix; on [7, 11] at W=1 it reads the sequence mean, with
    per_microbatch_mean as an alternative its counts cannot tell apart: the shrinker does not take it, and the note
    names both and keeps the unshrunk reading."""
    big, small = one_rank_of_one_row_microbatches()
    assert [[7, 11]] == small.counts()[0]
    (unshrunk,) = [v for v in judge_layout(CONTROL, big, OPTIONS) if v.check == "parity"]
    (shrunk,) = [v for v in judge_layout(CONTROL, small, OPTIONS) if v.check == "parity"]
    assert unshrunk.diagnosis is not None and shrunk.diagnosis is not None
    assert ("per_microbatch_mean", FAIL) == (unshrunk.diagnosis["signature"], unshrunk.status)
    assert fix_for("per_microbatch_mean") == unshrunk.fix == unshrunk.diagnosis["fix"]
    assert ("other_objective", "sequence_mean") == (shrunk.diagnosis["signature"],
                                                    shrunk.diagnosis["objective_computed"])
    assert "per_microbatch_mean" in shrunk.diagnosis["alternatives"]  # type: ignore[operator]
    assert "--objective" not in shrunk.message  # the option is the fix's, never the reading's sentence
    assert not keeps_reading(reading_key(unshrunk), [shrunk])
    note = shrunk_note(unshrunk, shrunk)
    assert note is not None and note.startswith(
        "the shrunk layout's counts cannot tell per_microbatch_mean from sequence_mean; the unshrunk layout reads "
        "per_microbatch_mean")


def test_the_drawn_verdict_on_a_mean_per_microbatch_shrinks_to_a_layout_that_still_reads_it() -> None:
    """The drawn lane on the real control: the verdict reads per_microbatch_mean and carries its fix; the shrunk
    layout reads per_microbatch_mean too, and nothing advises --objective=sequence_mean."""
    verdict = drawn_verdict(CONTROL, OPTIONS, derandomize=True, precision="fp32", strategy="ddp")
    assert FAIL == verdict.status and verdict.diagnosis is not None
    assert "per_microbatch_mean" == verdict.diagnosis["signature"]
    assert fix_for("per_microbatch_mean") == verdict.fix
    assert "--objective" not in verdict.message and "other_objective" not in verdict.message
    shrunk = verdict.message.split("shrunk (", 1)[1]
    assert "diagnosis (per_microbatch_mean)" in shrunk, verdict.message
