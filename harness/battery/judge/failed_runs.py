"""A failed launch read as a verdict: what the launcher said of each rank cut to the lines a reader needs (a
traceback's innermost frame and exception, a stuck rank's newest frames), where the ranks were when the deadline
struck, a rank that refused a window with tokens, and a recipe that broke the contract (a usage error).

Every check asks these first: a run that failed has no numbers to judge, and its verdict says how it failed.
"""

from __future__ import annotations

import re

from harness.battery.judge.crash_report import parse
from harness.battery.judge.verdict import Verdict, failed
from harness.battery.launch.run import Run
from harness.distributed.errors import LaunchError

_KIND_CAUSE = {"raised": "crash", "died": "died", "deadline": "deadline", "desync": "desync"}

_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("The above exception was the direct cause of the following exception:",
            "During handling of the above exception, another exception occurred:")
SHORT_BLOCK = 12
"""An exception block (its ``Type: message`` line and continuation lines) of at most this many lines is kept whole."""
_REMEDY = re.compile(
    r"find_unused_parameters|static_graph|use_reentrant|collective mismatch|connection closed|environment variable"
    r"|\b(?:TORCH|NCCL|GLOO|CUDA|OMP|MASTER)_[A-Z0-9_]+|parameter (?:indices|index|at index|names?)|\bwith name\b"
    r"|(?:did not|didn't|does not) receive grad|marked as ready|\bparameters? .*\bnames?\b|\bworkaround\b",
    re.IGNORECASE,
)
"""A line of a long exception block worth keeping: a remedy DDP, gloo or torch names (an option, a method, an
environment variable) or the culprit (parameter indices or names, a collective mismatch)."""


def _meaningful(text: str) -> list[str]:
    """Non-empty lines, right-stripped, without the caret underlines Python 3.11 puts under a frame's code."""
    return [ln.rstrip() for ln in text.splitlines() if ln.strip() and not set(ln.strip()) <= set("^~ ")]


def _exception_block(segment: list[str]) -> tuple[str | None, list[str]]:
    """A traceback segment's innermost frame and its exception block (``Type: message`` and every line after it)."""
    last = max((i for i, ln in enumerate(segment) if ln.lstrip().startswith('File "')), default=None)
    if last is None:
        return None, segment
    start = last + 1
    while start < len(segment) and segment[start].startswith("    "):
        start += 1  # the frame's code line
    return segment[last].strip(), segment[start:]


def _cut(block: list[str], limit: int) -> list[str]:
    """A short block whole; a long one as its first line, every line naming a remedy or a culprit, and its last
    line, with ``...`` where lines were left out."""
    if len(block) <= limit:
        return block
    keep = [0, *(i for i in range(1, len(block) - 1) if _REMEDY.search(block[i])), len(block) - 1]
    out: list[str] = []
    for prev, i in zip([-1, *keep], keep):
        if i - prev > 1:
            out.append(f"... ({i - prev - 1} line{'s' if i - prev > 2 else ''} left out)")
        out.append(block[i])
    return out


def crash_summary(text: str, limit: int = SHORT_BLOCK) -> list[str]:
    """The lines of a rank's report a reader needs, never the caret underlines of Python 3.11.

    For a traceback: what the launcher said before it (``died from SIGABRT``, the dead rank's last output, ``(rank 1
    then raised:)``), the innermost frame, and the exception's type and message: the whole block when it has at most
    ``limit`` lines (DDP's errors put the parameter indices and ``find_unused_parameters=True`` before a last line
    about ``TORCH_DISTRIBUTED_DEBUG``), else its first line, every line naming a remedy or a culprit, and its last
    line.
    A chained exception adds its innermost cause (``caused by: Type: message``). A stack (faulthandler's, newest
    frame first) gives its header and newest frames; any other text its first lines.
    """
    lines = _meaningful(text)
    if not lines:
        return ["(nothing reported)"]
    starts = [i for i, ln in enumerate(lines) if ln.strip() == _TRACEBACK]
    if not starts:
        frames = [i for i, ln in enumerate(lines) if ln.lstrip().startswith('File "')]
        if frames and any("most recent call first" in ln for ln in lines):
            return [ln.strip() for ln in lines[: frames[0]] + lines[frames[0] : frames[0] + 2]]
        return _cut([ln.strip() for ln in lines], limit)
    preamble = [ln.strip() for ln in lines[: starts[0]]]
    segments = [lines[a + 1 : b] for a, b in zip(starts, [*starts[1:], len(lines)])]
    segments = [[ln for ln in seg if ln.strip() not in _CHAINED] for seg in segments]
    frame, block = _exception_block(segments[-1])
    out = [*_cut(preamble, limit), *([frame] if frame else []), *_cut([ln.strip() for ln in block], limit)]
    if len(segments) > 1:
        _, cause = _exception_block(segments[0])
        if cause:
            out.append(f"caused by: {cause[0].strip()}")
            out += [ln.strip() for ln in cause[1:] if _REMEDY.search(ln)][: limit]
    return out


def failed_run(check: str, run: Run) -> Verdict | None:
    if run.failure is None:
        return None
    err = run.failure
    what = {"deadline": "hung past the deadline", "died": "lost a rank", "raised": "crashed",
            "desync": "left its ranks out of step"}.get(err.kind, err.kind)
    lines = [str(err).splitlines()[0]]
    for i, rank in enumerate(err.ranks):
        detail = err.details.get(rank, "")
        if i == 0:
            lines += [f"  rank {rank}: {ln}" for ln in crash_summary(detail)]
            # The innermost frame is often torch's, where the error was noticed: name the recipe's line too.
            crash = parse(detail, rank)
            if crash is not None and crash.frames:
                where = crash.frames[0]
                lines.append(f"  rank {rank}: raised from {where.file}:{where.line}, in {where.func}")
        elif _TRACEBACK in detail:
            # A peer that failed too: what the launcher said of it, and its exception's first line.
            shown = [ln for ln in crash_summary(detail) if not ln.startswith('File "')][:2]
            if len(shown) == 2 and any(ln.endswith(f": {shown[1]}") for ln in lines):
                shown = [f"{shown[0]}: the same {shown[1].split(':', 1)[0]}"]
            lines += [f"  rank {rank}: {ln}" for ln in shown]
        else:
            # A peer's faulthandler stack starts with its newest frame: where it was stuck.
            stack = [ln.strip() for ln in detail.splitlines() if ln.strip()]
            lines += [f"  rank {rank}: {ln}" for ln in stack[:3]]
    if err.kind == "deadline":
        lines.insert(1, f"  the time ran out {deadline_phase(err, len(run.windows))}")
        lines.append(f"  raise it with --battery-deadline SECONDS (pytest and the command line alike); "
                     f"this run had {'?' if err.deadline is None else f'{err.deadline:g}'} s")
    return failed(check, run, f"the run {what}: " + "\n".join(lines), cause=_KIND_CAUSE.get(err.kind, err.kind),
                  details=str(err))


def deadline_phase(err: LaunchError, windows: int) -> str:
    """Where the ranks still running at the deadline were, from the launcher's record of each rank (its function
    started or not, the last window it reported through ``progress``): ``"during start-up ..."``, ``"in window k of
    n ..."`` or ``"after the last window ..."``, with the ranks when they were in different places."""
    where: dict[str, list[int]] = {}
    for rank in err.ranks:
        step = err.progress.get(rank)
        k = 0 if step is None else step + 1
        if rank not in err.started and step is None:
            phase = "during start-up (the process group's rendezvous, before the first window)"
        elif k == 0:
            phase = f"in window 0 of {windows} (no window finished: the model's build, the recipe's setup() or its " \
                    "first backward_window)"
        elif k < windows:
            phase = f"in window {k} of {windows} (window {k - 1} finished)"
        else:
            phase = f"after the last window (all {windows} finished; the run's end)"
        where.setdefault(phase, []).append(rank)
    if len(where) == 1:
        return next(iter(where))
    return "; ".join(f"{phase} on rank(s) {ranks}" for phase, ranks in where.items())


def unexpected_error(check: str, run: Run) -> Verdict | None:
    assert run.records is not None
    for rank, records in enumerate(run.records):
        for k, rec in enumerate(records):
            if rec.error is not None and run.references[k] is not None:
                return failed(check, run, f"rank {rank} raised {rec.error} on a window with supervised tokens", k,
                              cause="refused")
    return None


def usage_error(check: str, run: Run) -> Verdict | None:
    """A rank that raised :class:`~harness.recipes.contract.ContractViolation`: a usage error, not a verdict on the
    numbers."""
    if run.failure is None:
        return None
    for rank, text in run.failure.details.items():
        for line in text.splitlines():
            if "ContractViolation:" in line:
                why = line.split("ContractViolation:", 1)[1].strip()
                return failed(check, run, f"usage error on rank {rank}: {why}", cause="usage",
                              details=str(run.failure))
    return None
