"""``--battery-skip CHECK[=reason]`` applied: the names checked against the registry, and a named check's verdicts
recorded as skipped, with the reason and what they would have said (:mod:`harness.battery.plan.selection` parses the
option; every surface calls :func:`check_skips` on it, then :func:`skip` on each verdict).

A skip never turns a failure into a pass unseen: the check still runs, its verdict keeps its message and its status in
``skipped_status``, and the summary (:mod:`harness.battery.report.summary`) lists every skipped check with what it said.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import harness.battery.judge.checks  # noqa: F401  (the checks register themselves when imported)
from harness.battery.judge.registry import REGISTRY
from harness.battery.judge.verdict import SKIPPED, Verdict


def skippable() -> tuple[str, ...]:
    """The names ``--battery-skip`` takes: every registered check, then the drawn lane's ``drawn``."""
    return (*REGISTRY, "drawn")


def check_skips(skips: Sequence[tuple[str, str]], option: str = "--battery-skip") -> tuple[tuple[str, str], ...]:
    """``skips`` if every name is a check (:func:`skippable`); ValueError naming the option, the value and the names it
    may take otherwise."""
    valid = skippable()
    for name, reason in skips:
        if name not in valid:
            given = name if reason == "no reason given" else f"{name}={reason}"
            msg = (f"{option}={given!r}: {name or 'no check'} is not a check of the battery; give one of "
                   f"{', '.join(valid)}, optionally with =reason (e.g. {option} 'empty_window=our loop skips empty "
                   "windows')")
            raise ValueError(msg)
    return tuple(skips)


def skip(verdict: Verdict, skips: Sequence[tuple[str, str]]) -> Verdict:
    """``verdict`` recorded as skipped when its check is among ``skips`` (its status kept in ``skipped_status``, its
    message unchanged, the reason beside them); else unchanged."""
    reason = dict(skips).get(verdict.check)
    if reason is None or verdict.status == SKIPPED:
        return verdict
    return replace(verdict, status=SKIPPED, skip_reason=reason, skipped_status=verdict.status)


def skip_all(verdicts: Sequence[Verdict], skips: Sequence[tuple[str, str]]) -> list[Verdict]:
    return [skip(v, skips) for v in verdicts]


def skip_message(verdict: Verdict) -> str:
    """A skipped verdict in one line: the check, the reason, and what it would have said."""
    would = {"fail": "would have FAILED", "pass": "would have passed", "n/a": "would not have applied"}
    first = verdict.message.strip().splitlines()[0] if verdict.message.strip() else ""
    return (f"check {verdict.check} skipped (--battery-skip, reason: {verdict.skip_reason}); it "
            f"{would.get(str(verdict.skipped_status), 'would have said')}: {first}")


__all__ = ["check_skips", "skip", "skip_all", "skip_message", "skippable"]
