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

A step that some ranks finished having run collectives while others never finished it names nobody from these
records alone: the others may be stuck in a collective of their own, or have crashed, and their stacks say which.

What a rank reports while still in a step (``progress(..., finished=False)``: the battery's rank program reports each
forward and backward, counting the gradient synchronizations it has begun) is read next, so that a run that dies
inside the step, where no rank has finished it, is still read: gloo aborts a rank whose collective met one of another
size, NCCL's watchdog one whose collective never completed, in the middle of a window. At the first step whose
records (a finished rank's, or the report of a rank still in it) all have a count and disagree, the same rule names
the rarer count (on a tie the smaller). A rank whose step ended in an exception of its own code reports no count
(:func:`collective_failure`), and then nobody is named: its exception is the cause. At a deadline, where a rank
that began fewer synchronizations may only be slower, only a step some rank finished is read this way.
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
    finished: bool = True
    """False: the rank was still in the step when it last reported (``note`` says what it had done so far, and
    ``collectives`` counts the collectives it had begun)."""


def ranks_phrase(ranks: Collection[int]) -> str:
    """``rank 1``, ``ranks 0 and 2``, ``ranks 0, 2 and 3``."""
    r = sorted(ranks)
    if len(r) == 1:
        return f"rank {r[0]}"
    return f"ranks {', '.join(map(str, r[:-1]))} and {r[-1]}"


def first_divergence(history: Mapping[int, Mapping[int, StepReport]], world_size: int,
                     working: Mapping[int, tuple[int, StepReport]] | None = None,
                     settled: bool = True) -> tuple[list[int], str] | None:
    """``(ranks at fault, sentence)`` for the first step at which the ranks' records disagree, or None when they
    agree wherever they can be compared (``history[rank][step]``; ranks that never reported a step are read as not
    having finished it). ``working[rank]``: ``(step, report)``, the last report of a rank still in a step, read where
    the finished records name nobody. ``settled``: whether the run ended in a collective (a rank aborted or raised
    there), so that reports from inside a step no rank finished can be compared; at a deadline they cannot (a rank
    that began fewer synchronizations may only be slower), and only a step some rank finished is read."""
    found = _finished_divergence(history, world_size)
    if found is not None or not working:
        return found
    return _working_divergence(history, working, world_size, settled)


def _finished_divergence(history: Mapping[int, Mapping[int, StepReport]],
                         world_size: int) -> tuple[list[int], str] | None:
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


def _working_divergence(history: Mapping[int, Mapping[int, StepReport]], working: Mapping[int, tuple[int, StepReport]],
                        world_size: int, settled: bool) -> tuple[list[int], str] | None:
    """The first step every rank has a record of (finished, or its report from inside the step), some rank never
    finished, and whose counts disagree: the rarer count named (on a tie the smaller), as for finished steps. A
    finished rank's synchronizations completed, so its peers had entered a matching collective: a peer with fewer
    begun went on to another one, whenever the run ended."""
    for step in sorted({s for s, _ in working.values()}):
        reports: dict[int, StepReport] = {}
        for r in range(world_size):
            if step in history.get(r, {}):
                reports[r] = history[r][step]
            elif r in working and working[r][0] == step:
                reports[r] = working[r][1]
        if len(reports) < world_size or all(rep.finished for rep in reports.values()):
            continue
        if not settled and not any(rep.finished for rep in reports.values()):
            continue  # a deadline: the rank with fewer synchronizations begun may only be slower
        if any(rep.collectives is None for rep in reports.values()):
            return None  # a rank raised in its own code (or did not count): its exception is the cause
        counts: dict[int, list[int]] = {}
        for r, rep in reports.items():
            counts.setdefault(rep.collectives, []).append(r)  # type: ignore[arg-type]
        if len(counts) < 2:
            continue
        odd = min(counts, key=lambda c: (len(counts[c]), c))
        culprits = counts[odd]
        others = [r for r in reports if r not in culprits]
        fewer = odd < reports[others[0]].collectives  # type: ignore[operator]
        # Fewer: the culprits went on to another collective (or none) while their peers sat in the one they skipped.
        met = (f", so the collective {ranks_phrase(others)} {'was' if len(others) == 1 else 'were'} in met another "
               "one or none" if fewer else "")
        return culprits, (f"{ranks_phrase(culprits)} {reports[culprits[0]].note}{met}: every rank must run the same "
                          f"collectives ({ranks_phrase(others)} {reports[others[0]].note})")
    return None


COLLECTIVE_FAILURES = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "gloo", "nccl",
                       "c10d", "processgroup")
"""How a collective's failure reads (a peer's abort, a timeout): a rank that failed this way was let down by a peer,
not by its own code."""


def collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a collective (torch's distributed errors, or gloo's or NCCL's text in a plain
    ``RuntimeError``): the rank had gone on to a collective, so the count it reported from inside the step stands."""
    import torch.distributed as dist

    distributed_error = getattr(dist, "DistError", None)
    if distributed_error is not None and isinstance(exc, distributed_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in COLLECTIVE_FAILURES)


__all__ = ["COLLECTIVE_FAILURES", "StepReport", "collective_failure", "first_divergence", "ranks_phrase"]
