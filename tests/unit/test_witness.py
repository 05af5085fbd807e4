"""Shrinking keeps the reading honest: the rule a drawn verdict follows when its shrunk layout reads otherwise than
the failing layout, or its counts cannot tell two readings apart (hand-built verdicts;
tests/distributed/test_shrunk_reading.py runs it on the real control)."""

from __future__ import annotations

from harness.battery.judge.verdict import FAIL, Verdict
from harness.battery.judge.witness import keeps_reading, reading_key, reading_of, shrunk_note, witness


def _parity(signature: str, alternatives: tuple[str, ...] = (), objective: str | None = None) -> Verdict:
    diagnosis = {"signature": signature, "alternatives": list(alternatives), "objective_computed": objective}
    return Verdict("parity", "r", "drawn", 2, "fp32", FAIL, "parity off", cause="numbers", diagnosis=diagnosis,
                   fix=f"fix of {signature}")


MEAN = _parity("per_microbatch_mean")
AMBIGUOUS = _parity("other_objective", ("per_microbatch_mean",), "sequence_mean")


def test_a_shrunk_layout_whose_counts_cannot_tell_the_readings_apart_says_so_and_keeps_the_unshrunk_one() -> None:
    """The unshrunk layout reads a mean per microbatch, the shrunk one the sequence mean with the mean per
    microbatch as its alternative: the note names both and the unshrunk reading as the verdict's."""
    assert ("the shrunk layout's counts cannot tell per_microbatch_mean from sequence_mean; the unshrunk layout reads "
            "per_microbatch_mean, and the verdict's reading and fix are its (the shrunk reading's advice does not "
            "hold)") == shrunk_note(MEAN, AMBIGUOUS)


def test_a_shrunk_layout_that_reads_the_same_adds_nothing() -> None:
    """The same reading, unambiguous: no note (the control of the rule above)."""
    assert None is shrunk_note(MEAN, _parity("per_microbatch_mean"))


def test_a_shrunk_layout_reading_the_same_with_alternatives_says_its_counts_cannot_tell_them_apart() -> None:
    """The same reading, but its counts cannot tell it from a global scale: said, the unshrunk reading kept."""
    note = shrunk_note(MEAN, _parity("per_microbatch_mean", ("global_scale",)))
    assert note is not None and note.startswith("the shrunk layout's counts cannot tell per_microbatch_mean from "
                                                "global_scale")


def test_a_shrunk_layout_reading_another_mistake_outright_is_named_as_such() -> None:
    """A shrunk reading that is no alternative of the unshrunk one: both named, the unshrunk one the verdict's."""
    note = shrunk_note(MEAN, _parity("mean_of_local_means"))
    assert note is not None
    assert note.startswith("the shrunk layout reads mean_of_local_means where the unshrunk layout reads "
                           "per_microbatch_mean")


def test_a_candidate_is_kept_only_where_it_fails_with_the_same_reading() -> None:
    """The shrinker's predicate: the same check and reading keep a candidate; another objective's reading (even one
    whose alternatives hold the original), another check, or a pass do not."""
    want = reading_key(MEAN)
    assert ("parity", "per_microbatch_mean") == want
    assert keeps_reading(want, [_parity("per_microbatch_mean", ("global_scale",))])
    assert not keeps_reading(want, [AMBIGUOUS])
    one_sync = Verdict("one_sync", "r", "drawn", 2, "fp32", FAIL, "twice", cause="numbers")
    assert not keeps_reading(want, [one_sync])
    assert not keeps_reading(want, [])
    assert "sequence_mean" == reading_of(AMBIGUOUS)
    assert MEAN is witness([one_sync, MEAN])
