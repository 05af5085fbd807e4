"""The reading a drawn layout witnesses, kept through shrinking: which failing verdict's reading a drawn verdict
reports (:func:`witness`), whether a smaller candidate layout still fails with it (:func:`keeps_reading`), and what
the verdict says when a shrunk layout's counts read otherwise or cannot tell two readings apart (:func:`shrunk_note`).
:func:`harness.battery.layouts.drawn_verdict` uses them; ``tests/unit/test_witness.py`` holds the rule."""

from __future__ import annotations

from collections.abc import Sequence

from harness.battery.judge.verdict import Verdict


def witness(verdicts: Sequence[Verdict]) -> Verdict:
    """The failing verdict whose reading a drawn verdict reports: the first with a diagnosis, else the first."""
    return next((v for v in verdicts if v.diagnosis is not None), verdicts[0])


def reading_of(verdict: Verdict) -> str | None:
    """A failing verdict's reading, named: its diagnosis's signature (another objective by that objective's name,
    ``sequence_mean``), else its finding."""
    d = verdict.diagnosis
    if d is None:
        return verdict.finding
    if d.get("signature") == "other_objective" and d.get("objective_computed"):
        return str(d["objective_computed"])
    return None if d.get("signature") is None else str(d["signature"])


def reading_key(verdict: Verdict) -> tuple[str, str | None]:
    """What a shrunk layout must keep: the check that failed and its reading."""
    return verdict.check, reading_of(verdict)


def keeps_reading(want: tuple[str, str | None], failing: Sequence[Verdict]) -> bool:
    """Whether a candidate's failing verdicts hold the failing layout's reading ``want`` (:func:`reading_key`)."""
    return bool(failing) and reading_key(witness(failing)) == want


def _alternatives(verdict: Verdict) -> list[str]:
    d = verdict.diagnosis or {}
    return [str(a) for a in d.get("alternatives") or []]  # type: ignore[attr-defined]


def shrunk_note(unshrunk: Verdict, shrunk: Verdict) -> str | None:
    """What a drawn verdict says when its shrunk layout's reading is not the failing layout's, or its counts cannot
    tell two readings apart: the failing (unshrunk) layout's reading is the verdict's, with its fix, and an option
    (--objective) the shrunk reading would advise is not advised. None: the shrunk layout reads the same, unambiguously.
    """
    was, now = reading_of(unshrunk), reading_of(shrunk)
    if was is None or now is None:
        return None
    apart = [a for a in _alternatives(shrunk) if a != was]
    if was == now and not apart:
        return None
    if was == now:
        return (f"the shrunk layout's counts cannot tell {was} from {', '.join(apart)}; the unshrunk layout reads "
                f"{was}, and the verdict's reading and fix are its")
    if was in _alternatives(shrunk) or now in _alternatives(unshrunk):
        return (f"the shrunk layout's counts cannot tell {was} from {now}; the unshrunk layout reads {was}, and the "
                "verdict's reading and fix are its (the shrunk reading's advice does not hold)")
    return (f"the shrunk layout reads {now} where the unshrunk layout reads {was} (a smaller layout can make several "
            f"mistakes give one gradient): the unshrunk layout reads {was}, and the verdict's reading and fix are its "
            "(the shrunk reading's advice does not hold)")


__all__ = ["keeps_reading", "reading_key", "reading_of", "shrunk_note", "witness"]
