"""Fault injection for the kill-and-resume tests: where a rank may be killed, and the kill itself.

``HARNESS_FAULT="rank=1,step=37,point=in-window"`` names one rank, one step and one point; the rank that reaches it
writes a line to ``run_dir/fault-fired.txt`` and kills itself with SIGKILL, as a real crash would: no finally blocks,
no flushes, no released locks. The trainer calls :func:`die_at` at every point (inside a step's window, and through
``save_checkpoint``'s ``point`` callback); it does nothing unless the fault names exactly this rank, step and point.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

FAULT_ENV = "HARNESS_FAULT"
FAULT_POINTS = ("in-window", "after-rank-temp", "before-manifest", "after-manifest")
"""Where a rank can be killed: ``in-window`` between the first and second microbatch of a step's window;
``after-rank-temp`` after the rank file's temporary write, before its rename; ``before-manifest`` (rank 0) after every
rank file is in, before the manifest; ``after-manifest`` once the checkpoint is complete."""


@dataclass(frozen=True)
class Fault:
    """Kill ``rank`` with SIGKILL at ``point`` of step ``step`` (1-based: the step whose update or checkpoint it is)."""

    rank: int
    step: int
    point: str


def parse_fault(value: str | None) -> Fault | None:
    """Parse ``HARNESS_FAULT="rank=1,step=37,point=in-window"``; None or empty means no fault."""
    if not value:
        return None
    allowed = ", ".join(FAULT_POINTS)
    fix = f"use e.g. {FAULT_ENV}='rank=1,step=37,point=in-window' with point one of: {allowed}"
    try:
        fields = dict(part.split("=", 1) for part in value.split(","))
    except ValueError:
        fields = {}
    if set(fields) != {"rank", "step", "point"}:
        msg = f"{FAULT_ENV}={value!r} must give exactly rank=, step= and point=; {fix}"
        raise ValueError(msg)
    try:
        rank, step = int(fields["rank"]), int(fields["step"])
    except ValueError:
        msg = f"{FAULT_ENV}={value!r}: rank and step must be integers; {fix}"
        raise ValueError(msg) from None
    point = fields["point"].strip()
    if point not in FAULT_POINTS:
        msg = f"{FAULT_ENV}={value!r}: point={point!r} is not a fault point; {fix}"
        raise ValueError(msg)
    if rank < 0 or step < 1:
        msg = f"{FAULT_ENV}={value!r}: rank must be >= 0 and step >= 1; {fix}"
        raise ValueError(msg)
    if point == "before-manifest" and rank != 0:
        msg = f"{FAULT_ENV}={value!r}: only rank 0 writes the manifest, so point=before-manifest needs rank=0"
        raise ValueError(msg)
    return Fault(rank, step, point)


FAULT_RECORD = "fault-fired.txt"
"""Written into the run directory by the rank a fault kills, just before it dies: proof the kill came from the fault."""


def die_at(fault: Fault | None, rank: int, step: int, point: str, run_dir: str | Path) -> None:
    """SIGKILL this process if ``fault`` names this rank, step and point, after recording it in ``run_dir``."""
    if fault is not None and (fault.rank, fault.step, fault.point) == (rank, step, point):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(run_dir) / FAULT_RECORD, "a") as f:
            f.write(f"rank={rank},step={step},point={point}\n")
        # SIGKILL, not an exception: a real crash runs no finally blocks, flushes nothing, releases no lock.
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["FAULT_ENV", "FAULT_POINTS", "FAULT_RECORD", "Fault", "die_at", "parse_fault"]
