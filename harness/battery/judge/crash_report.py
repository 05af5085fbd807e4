"""A recipe's crash said once: the exception, and the line of the user's code that raised it.

A rank's traceback ends in torch (``functional.py``'s ``cross_entropy``), which is where the error was noticed, not
what to change. :func:`culprit` picks the innermost frame outside the harness, torch and Python's standard library:
the user's code; where that frame is a library's (transformers, accelerate), the user's own frame that called into it
too. :func:`read_crash` reads a launch failure's first traceback; :func:`grouped` prints the crash verdicts of a
whole matrix once per distinct exception, with how many cases raised it and where.
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass

from harness.battery.judge.crash_hints import hint
from harness.battery.judge.verdict import Verdict

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_TRACEBACK = "Traceback (most recent call last):"
_HARNESS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_STDLIB = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})
_LIBRARIES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str
    source: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}, in {self.func}" + (f"\n    {self.source}" if self.source else "")


@dataclass(frozen=True)
class Crash:
    """One rank's exception: ``exception`` (``Type: message``, its first line), ``rank``, and ``frames``: the user's
    frame, after it the library frame it called into when the innermost non-torch frame is a library's."""

    exception: str
    rank: int | None
    frames: tuple[Frame, ...]

    @property
    def key(self) -> tuple[str, tuple[Frame, ...]]:
        """What two crashes share when they are the same: the exception and where the user's code raised it."""
        return self.exception, self.frames

    def lines(self) -> list[str]:
        """The exception, where, and the known fix, as indented lines."""
        out = [f"  {self.exception}"]
        for i, frame in enumerate(self.frames):
            out += [f"  {'at' if i == 0 else 'inside'} {ln}" if j == 0 else f"  {ln}"
                    for j, ln in enumerate(str(frame).splitlines())]
        said = hint(self.exception)
        if said:
            out.append(f"  fix: {said}")
        return out


def _kind(path: str) -> str:
    """``"internal"`` (the harness, torch, the standard library, ``<string>``), ``"library"`` or ``"user"``."""
    real = os.path.realpath(path)
    if path.startswith("<") or real.startswith(_HARNESS) or path.startswith(_HARNESS):
        return "internal"
    if any(lib in real for lib in _LIBRARIES):
        top = real.split("-packages" + os.sep, 1)[1].split(os.sep, 1)[0]
        return "internal" if top in ("torch", "functorch", "triton") else "library"
    return "internal" if real.startswith(_STDLIB) else "user"


def frames(segment: Sequence[str]) -> list[Frame]:
    """The frames of one traceback segment, outermost first, each with its source line."""
    out = []
    for i, ln in enumerate(segment):
        m = _FRAME.match(ln)
        if m:
            nxt = segment[i + 1] if i + 1 < len(segment) else ""
            source = nxt.strip() if nxt.startswith("    ") and not _FRAME.match(nxt) else ""
            out.append(Frame(m["file"], int(m["line"]), m["func"].strip(), source))
    return out


def culprit(found: Sequence[Frame]) -> tuple[Frame, ...]:
    """The innermost frame outside the harness, torch and the standard library; when it is a library's, the
    user's innermost frame before it, then that library frame. Empty when every frame is internal."""
    kinds = [_kind(f.file) for f in found]
    outside = [i for i, k in enumerate(kinds) if k != "internal"]
    if not outside:
        return ()
    inner = outside[-1]
    if kinds[inner] == "user":
        return (found[inner],)
    own = [i for i in outside if kinds[i] == "user" and i < inner]
    return (found[own[-1]], found[inner]) if own else (found[inner],)


def parse(text: str, rank: int | None = None) -> Crash | None:
    """The crash in one rank's report (a traceback, possibly chained: the last one raised), or None."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.strip() == _TRACEBACK]
    if not starts:
        return None
    segment = lines[starts[-1] + 1:]
    found = frames(segment)
    exception = next((ln.strip() for ln in segment if ln.strip() and not ln.startswith(" ")
                      and not _FRAME.match(ln)), "")
    if not exception:
        return None
    # The user's frame may be in an earlier segment (a chained exception raised inside torch).
    every = frames(lines[starts[0]:])
    return Crash(exception, rank, culprit(found) or culprit(every))


def read_crash(failure: object) -> Crash | None:
    """The first raising rank's crash in a :class:`~harness.distributed.errors.LaunchError`, or None when no rank
    raised (a death, a deadline, a desync)."""
    if getattr(failure, "kind", None) != "raised":
        return None
    details: dict[int, str] = getattr(failure, "details", {})
    for rank in getattr(failure, "ranks", ()):
        crash = parse(details.get(rank, ""), rank)
        if crash is not None:
            return crash
    return None


def every_rank_raised(failure: object, world: int) -> bool:
    """Whether all ``world`` ranks raised the same exception at the same line in a failed run (none died, hung, or
    failed in a collective a peer left): the ranks can go on to the next run."""
    details: dict[int, str] = getattr(failure, "details", {})
    crashes = [parse(details.get(r, "")) for r in range(world)]
    return getattr(failure, "kind", None) == "raised" and len({c.key if c else None for c in crashes}) == 1 \
        and crashes[0] is not None


def _ranges(values: Sequence[object]) -> str:
    return ",".join(str(v) for v in dict.fromkeys(values))


def grouped(verdicts: Sequence[Verdict]) -> list[str]:
    """Each distinct exception among the crash verdicts once: ``raised in N cases (W=.., scenarios ..)``, with its
    frame and fix. Every verdict keeps its own details in the report; this is only what is printed."""
    groups: dict[tuple[str, tuple[Frame, ...]], tuple[Crash, list[Verdict]]] = {}
    for v in verdicts:
        if v.passed or v.cause != "crash" or not v.details:
            continue
        crash = parse(v.details.split("--- rank ", 2)[1] if "--- rank " in v.details else v.details)
        if crash is None:
            continue
        groups.setdefault(crash.key, (crash, []))[1].append(v)
    out = []
    for crash, members in groups.values():
        cases = len({(v.scenario, v.world_size, v.precision, v.strategy, v.mesh) for v in members})
        worlds = _ranges(sorted({v.world_size for v in members if v.world_size}))  # a drawn row's is 0: several
        where = _ranges([v.scenario for v in members])
        out.append(f"the recipe raised in {cases} case{'s' if cases != 1 else ''} (W={worlds}; scenarios {where}; "
                   f"{len(members)} verdict{'s' if len(members) != 1 else ''}):")
        out += crash.lines()
    return out
