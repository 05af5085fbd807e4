"""The resume battery's options, parsed once for the command line and the pytest plugin. Pure Python: the plugin
reads them at start-up, and a pytest run that runs no resume test must not pay for torch."""

from __future__ import annotations

from dataclasses import dataclass

KILL_POINTS = ("in-step", "in-save", "before-commit", "after-commit")
"""``in-step``: at the second module forward of the step on the killed rank (inside its computation, before its
update); ``in-save``: once the killed rank's own ``save`` has returned, while its peers may still be writing and
nothing is committed; ``before-commit`` (rank 0): every rank's files are in, the manifest is not; ``after-commit``:
the checkpoint is complete."""

CASES = ("repeatable", "stop-resume", "resume-of-resume", *(f"kill-{p}" for p in KILL_POINTS))
"""The battery's cases, in the order they run (:mod:`harness.resume.battery` says what each does)."""


@dataclass(frozen=True, kw_only=True)
class ResumeOptions:
    """How the battery runs a trainer; the command line and the pytest plugin parse into this one class."""

    steps: int = 20
    """S: the continuous run's length, in optimizer steps."""
    every: int = 5
    """A checkpoint every this many steps (and at every stop)."""
    world_size: int = 2
    """Ranks of every leg."""
    seed: int = 0
    """Seeds the global generators per rank, and the draw of the stop and kill steps."""
    deadline: float = 120.0
    """Seconds one leg may take."""
    cases: tuple[str, ...] = CASES
    """Which cases run (``repeatable`` always runs first, whatever this says)."""

    def __post_init__(self) -> None:
        for name in ("steps", "every", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"resume {name}={value!r} must be a positive integer"
                raise ValueError(msg)
        if self.steps < 3 * self.every + 1:
            msg = (f"resume steps={self.steps} must be at least 3 * every + 1 = {3 * self.every + 1}: the stops and "
                   "kills are drawn between checkpoints, after the first one; raise --resume-steps or lower "
                   "--resume-every")
            raise ValueError(msg)
        unknown = [c for c in self.cases if c not in CASES]
        if unknown or not self.cases:
            msg = f"resume cases={','.join(self.cases)!r} must name one or more of {', '.join(CASES)}"
            raise ValueError(msg)
        if not self.deadline > 0:
            msg = f"resume deadline={self.deadline!r} must be a positive number of seconds"
            raise ValueError(msg)



__all__ = ["CASES", "KILL_POINTS", "ResumeOptions"]
