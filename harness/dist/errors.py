"""What a launch reports: :class:`LaunchError` when a run fails, :class:`Expected` for a declared exception."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Expected:
    """An exception a rank raised that the caller declared expected (``launch(..., expect=(ValueError,))``)."""

    type: str
    message: str

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


class LaunchError(RuntimeError):
    """A multi-rank run failed: a rank raised, died, fell out of lockstep, or outlived the deadline.

    ``kind`` is ``"raised"``, ``"died"``, ``"desync"`` or ``"deadline"``; ``ranks`` names the ranks at fault (for
    ``"desync"``: the ranks left behind); ``details`` maps each of them to its traceback, exit reason or stack. For
    ``"desync"``, ``leader`` is the rank that moved on and ``details[leader]`` says how far, with its note.
    """

    def __init__(self, kind: str, ranks: Sequence[int], details: Mapping[int, str], summary: str,
                 leader: int | None = None) -> None:
        self.kind = kind
        self.ranks = tuple(ranks)
        self.details = dict(details)
        self.leader = leader
        parts = [summary]
        for rank in self.ranks:
            parts.append(f"--- rank {rank} ---\n{self.details.get(rank, '(nothing reported)').rstrip()}")
        if leader is not None and leader not in self.ranks and leader in self.details:
            parts.append(f"--- rank {leader} (ahead) ---\n{self.details[leader].rstrip()}")
        super().__init__("\n".join(parts))

