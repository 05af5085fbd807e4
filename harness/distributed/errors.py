"""What a launch reports: :class:`LaunchError` when a run fails, :class:`Expected` for a declared exception."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Expected:
    """An exception a rank raised that the caller declared expected (``launch(..., expect=(ValueError,))``)."""

    type: str
    message: str

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


DEATHS = ("died from ", "exited with status ", "stopped answering")
"""How the details of a rank that ended without sending a result begin."""


class LaunchError(RuntimeError):
    """A multi-rank run failed: a rank raised, died, fell out of lockstep, or outlived the deadline.

    ``kind`` is ``"raised"``, ``"died"``, ``"desync"`` or ``"deadline"``; ``ranks`` names the ranks at fault (for
    ``"desync"``: the ranks left behind); ``details`` maps each of them to its traceback, exit reason or stack. For
    ``"desync"``, ``leader`` is the rank that moved on and ``details[leader]`` says how far, with its note.

    ``output`` maps each rank that printed anything to its whole stdout and stderr (the launcher also relays them to
    the caller's stderr unless ``relay_output=False``); a rank that died without a traceback has its last lines
    of output added to its ``details`` (where gloo says "collective mismatch"). ``progress`` maps every rank to the
    highest step it reported through :func:`~harness.distributed.launcher.progress` (None: none), ``started`` names the
    ranks whose function had started (past the rendezvous), and ``deadline`` is the run's deadline in seconds.

    ``cause``: where the ranks' own records (:mod:`harness.distributed.divergence`) show that one rank left the
    collectives its peers ran, the sentence naming it (``"rank 1 skipped the backward of window 3: every rank must
    run the same collectives (...)"``); the error is then a ``"desync"`` led by that rank, whatever symptom ended the
    run (a peer's death in gloo's mismatch, a deadline), and the message starts with the sentence. None otherwise.
    """

    def __init__(self, kind: str, ranks: Sequence[int], details: Mapping[int, str], summary: str,
                 leader: int | None = None, *, progress: Mapping[int, int | None] | None = None,
                 started: Sequence[int] = (), deadline: float | None = None) -> None:
        self.kind = kind
        self.ranks = tuple(ranks)
        self.details = dict(details)
        self.leader = leader
        self.summary = summary
        self.output: dict[int, str] = {}
        self.progress: dict[int, int | None] = dict(progress or {})
        self.started = tuple(started)
        self.deadline = deadline
        self.cause: str | None = None
        super().__init__(self._compose())

    def name_cause(self, culprits: Sequence[int], cause: str) -> None:
        """The run failed because ``culprits`` left the collectives their peers ran (``cause`` says how): a desync
        led by them, whatever ended it; what the launcher said first (the death, the deadline) follows the cause."""
        self.kind = "desync"
        self.ranks = tuple(dict.fromkeys([*culprits, *self.ranks]))
        self.cause = cause
        self.args = (self._compose(),)

    def attach_output(self, output: Mapping[int, str], last: Callable[[str], list[str]]) -> None:
        """Keep every rank's ``output``; a rank that died (its details start with how it ended: it sent no
        traceback) gets the lines ``last`` picks from its output after that first line, and the message is rebuilt."""
        self.output = dict(output)
        for rank in self.ranks:
            head, _, rest = self.details.get(rank, "").partition("\n")
            said = last(output.get(rank, ""))
            if said and head.startswith(DEATHS):
                self.details[rank] = "\n".join([head, "(its last output:)", *said, *([rest] if rest else [])])
        self.args = (self._compose(),)

    def _compose(self) -> str:
        parts = [self.summary] if self.cause is None else [self.cause, f"(then: {self.summary})"]
        for rank in self.ranks:
            parts.append(f"--- rank {rank} ---\n{self.details.get(rank, '(nothing reported)').rstrip()}")
        if self.leader is not None and self.leader not in self.ranks and self.leader in self.details:
            parts.append(f"--- rank {self.leader} (ahead) ---\n{self.details[self.leader].rstrip()}")
        return "\n".join(parts)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.kind, self.ranks, self.details, self.summary, self.leader, self.progress,
                           self.started, self.deadline, self.output, self.cause))


def _rebuild(kind: str, ranks: Sequence[int], details: Mapping[int, str], summary: str, leader: int | None,
             progress: Mapping[int, int | None], started: Sequence[int], deadline: float | None,
             output: Mapping[int, str], cause: str | None = None) -> LaunchError:
    err = LaunchError(kind, ranks, details, summary, leader, progress=progress, started=started, deadline=deadline)
    err.output = dict(output)
    if cause is not None:
        err.cause = cause
        err.args = (err._compose(),)
    return err

