"""Which rank left the collectives its peers ran, read from what every rank reported per step when a run failed.

A rank that skips a collective its peers run (a backward skipped on an empty window, so DDP's all-reduce has one
party fewer) rarely fails where it made the mistake: its peers wait in the collective it skipped, and it goes on to
its next collective, which may pair with theirs and abort in gloo ("Received data size doesn't match expected
size"), wait with them until a timeout, or run ahead and trip the lockstep grace. Whichever of these ends the run
(a lost rank, a deadline, a desync), the symptom names the wrong rank or none. What names the cause is the record
each rank kept through :func:`harness.distributed.launcher.progress`: per step, a note saying what it did and how
many of the collectives every rank must run together it ran (``collectives``; the battery's rank program reports its
gradient synchronizations, counted by the strategy's hook). The first step at which those records disagree is where
the ranks parted:

- ranks that finished the step with different counts: the ranks holding the rarer count (on a tie, the smaller
  count: skipping is commoner than adding) are named;
- ranks that finished it having run none while peers never finished it: the finishers left their peers waiting in a
  collective they skipped.

A step that some ranks finished having run collectives while others never finished it names nobody: the others may
be stuck in a collective of their own, or have crashed, and their stacks say which.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class StepReport:
    """What one rank said when it finished one step: ``note`` (a phrase: ``"skipped the backward of window 3"``) and
    how many of the collectives every rank must run together it ran in the step (None: it did not count)."""

    note: str
    collectives: int | None = None


def ranks_phrase(ranks: Collection[int]) -> str:
    """``rank 1``, ``ranks 0 and 2``, ``ranks 0, 2 and 3``."""
    r = sorted(ranks)
    if len(r) == 1:
        return f"rank {r[0]}"
    return f"ranks {', '.join(map(str, r[:-1]))} and {r[-1]}"


def first_divergence(history: Mapping[int, Mapping[int, StepReport]], world_size: int) -> tuple[list[int], str] | None:
    """``(ranks at fault, sentence)`` for the first step at which the ranks' records disagree, or None when they
    agree wherever they can be compared (``history[rank][step]``; ranks that never reported a step are read as not
    having finished it)."""
    steps = sorted({s for reports in history.values() for s, rep in reports.items() if rep.collectives is not None})
    for step in steps:
        done = {r: history[r][step] for r in sorted(history) if step in history[r]}
        counted = {r: rep for r, rep in done.items() if rep.collectives is not None}
        pending = [r for r in range(world_size) if r not in done]
        counts: dict[int, list[int]] = {}
        for r, rep in counted.items():
            counts.setdefault(rep.collectives, []).append(r)  # type: ignore[arg-type]
        if len(counts) > 1:
            # The rarer count is the odd one out; on a tie the smaller (a skipped collective is commoner).
            odd = min(counts, key=lambda c: (len(counts[c]), c))
            culprits = counts[odd]
            others = [r for r in counted if r not in culprits]
            return culprits, (f"{ranks_phrase(culprits)} {counted[culprits[0]].note}: every rank must run the same "
                              f"collectives ({ranks_phrase(others)} {counted[others[0]].note})")
        if not counted:
            continue
        if pending and next(iter(counts)) == 0:
            culprits = list(counted)
            return culprits, (f"{ranks_phrase(culprits)} {counted[culprits[0]].note}: every rank must run the same "
                              f"collectives ({ranks_phrase(pending)} never finished it: "
                              + ("its stack shows where it waited)" if len(pending) == 1 else
                                 "their stacks show where they waited)"))
        if pending:
            return None  # finished having run collectives: the ranks left in the step are stuck, or crashed, there
    return None


__all__ = ["StepReport", "first_divergence", "ranks_phrase"]
