"""What the ranks printed over a whole battery, said once per distinct line at its end.

A recipe's ``print`` runs on every rank of every launch, and a library's warning (accelerate's, transformers') comes
again in each launch: relayed per launch they bury the verdicts. While a :class:`Printed` collects (:func:`start`),
the battery's launches (:func:`harness.battery.launch.runner.launch_run`) hand it their ranks' output (:func:`record`)
instead of relaying it, and :meth:`Printed.lines` gives each distinct line once, with how many ranks and launches
printed it (``[printed by 38 ranks in 12 launches] hello from my step``), the first :data:`SHOWN` of them unless every
one is asked for; ``-v`` relays them as they come instead. Other launches (the launcher's own callers) still relay.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from harness.distributed import output

SHOWN = 5
"""Distinct lines printed at the end of a battery without ``-v``."""


@dataclass
class Printed:
    """Each distinct line the ranks printed: how many ranks printed it, in how many launches (first seen first)."""

    ranks: dict[str, int] = field(default_factory=dict)
    launches: dict[str, int] = field(default_factory=dict)
    here: dict[str, int] = field(default_factory=dict)
    """Lines printed in this process while it built the user's model (the probe, the reference), with their count."""

    def add_here(self, text: str) -> None:
        """What this process printed while building the model once (:func:`building`)."""
        for line in dict.fromkeys(messages(text)):
            self.here[line] = self.here.get(line, 0) + 1

    def add(self, texts: Mapping[int, str]) -> None:
        """One launch's output, each rank's whole text (what :func:`harness.distributed.output.read` returns)."""
        seen: dict[str, int] = {}
        for _, text in sorted(texts.items()):
            for line in dict.fromkeys(messages(text)):
                seen[line] = seen.get(line, 0) + 1
        for line, n in seen.items():
            self.ranks[line] = self.ranks.get(line, 0) + n
            self.launches[line] = self.launches.get(line, 0) + 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        """Plain dicts (what an xdist worker can send its controller)."""
        return {"ranks": dict(self.ranks), "launches": dict(self.launches), "here": dict(self.here)}

    def merge(self, other: Mapping[str, Mapping[str, int]]) -> None:
        """Add another collection's counts (an :meth:`as_dict`)."""
        for line, n in other["ranks"].items():
            self.ranks[line] = self.ranks.get(line, 0) + n
            self.launches[line] = self.launches.get(line, 0) + other["launches"][line]
        for line, n in other.get("here", {}).items():
            self.here[line] = self.here.get(line, 0) + n

    def lines(self, shown: int | None = SHOWN) -> list[str]:
        """Each distinct line with its counts; past ``shown`` (None: no limit), one line counting the rest."""
        out = []
        for line, n in self.ranks.items():
            k = self.launches[line]
            out.append(f"[printed by {n} rank{'s' if n != 1 else ''} in {k} launch{'es' if k != 1 else ''}] {line}")
        for line, n in self.here.items():
            out.append(f"[printed {n} time{'s' if n != 1 else ''} building the model in the battery's process] {line}")
        if shown is not None and len(out) > shown:
            rest = len(out) - shown
            out = [*out[:shown], f"{rest} more distinct line{'s' if rest != 1 else ''}: -v shows them"]
        return out

    def block(self, shown: int | None = SHOWN) -> str:
        """The end-of-battery block: a heading and :meth:`lines`, or ``""`` when no rank printed anything."""
        said = self.lines(shown)
        return "what the ranks printed (each distinct line once):\n" + "\n".join(f"  {ln}" for ln in said) \
            if said else ""


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Around a build of the user's model in the battery's own process (the probe, the reference chain): what its
    constructor prints (nanoGPT's "number of parameters") goes to the collecting :class:`Printed`, once per distinct
    line with its count, instead of once per build; nothing is caught while nothing collects."""
    if not collecting():
        yield
        return
    import io

    caught = io.StringIO()
    try:
        with contextlib.redirect_stdout(caught), contextlib.redirect_stderr(caught):
            yield
    finally:
        record_here(caught.getvalue())


def record_here(text: str) -> None:
    """Text printed in this process while building the model, to the innermost collecting :class:`Printed`."""
    if text.strip() and _ACTIVE and _ACTIVE[-1] is not None:
        _ACTIVE[-1].add_here(text)


def messages(text: str) -> list[str]:
    """A rank's output as messages: each line, except that a warning's indented source line (Python's
    ``warnings.warn(`` under ``file:line: UserWarning: ...``) belongs to its warning, not a message of its own."""
    out: list[str] = []
    for raw in text.splitlines():
        if not raw.strip():
            continue
        if out and raw[:1].isspace() and "Warning: " in out[-1]:
            continue  # the line of source Python prints under a warning
        out.append(output.same_line(raw))
    return out


_ACTIVE: list[Printed | None] = []
"""The collections started and not stopped, innermost last (None: ``verbose``, relay): a battery run inside a pytest
session that collects its own has its own, and the session's resumes after it."""


def start(verbose: bool, printed: Printed | None = None) -> Printed:
    """Collect every following battery launch's rank output into ``printed`` (default: a new :class:`Printed`) until
    :func:`stop`; under ``verbose`` relay each launch's lines as they come instead."""
    printed = Printed() if printed is None else printed
    _ACTIVE.append(None if verbose else printed)
    return printed


def collecting() -> bool:
    """Whether a battery launch should hand its ranks' output to :func:`record` rather than relay it."""
    return bool(_ACTIVE) and _ACTIVE[-1] is not None


def record(texts: Mapping[int, str]) -> None:
    """One battery launch's rank output, to the innermost collecting :class:`Printed` (none: nothing)."""
    if _ACTIVE and _ACTIVE[-1] is not None:
        _ACTIVE[-1].add(texts)


def stop(printed: Printed) -> str:
    """End the innermost collection (what was collecting before it resumes); ``printed``'s end-of-battery block."""
    if _ACTIVE:
        _ACTIVE.pop()
    return printed.block()


@contextlib.contextmanager
def captured(quiet: bool = True) -> Iterator[list[str]]:
    """In a torchrun worker, which is itself a rank: what the block prints to file descriptors 1 and 2 (Python's and
    C++'s), appended to the yielded list when it ends, instead of the worker's output (``quiet=False``: nothing
    captured, the list stays empty)."""
    said: list[str] = []
    if not quiet:
        yield said
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield said
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
            f.seek(0)
            said.append(f.read(output.MAX_BYTES).decode(errors="replace"))
