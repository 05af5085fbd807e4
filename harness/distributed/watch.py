"""The parent's side of a launch: watch every rank's pipe and process until each has a result, and stop them all
at the first failure, a lockstep desync or the deadline, with each live rank's Python stack. See
:mod:`harness.distributed.launcher`.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from harness.distributed.divergence import StepReport, first_divergence
from harness.distributed.errors import LaunchError


class Watch:
    """The parent's view of one run: each rank's pipe (progress notices, then one result) and process sentinel."""

    def __init__(self, procs: list[Any], conns: dict[Connection, int], tmp: str, deadline: float,
                 grace: float | None) -> None:
        self.procs = procs
        self.tmp = tmp
        self.deadline = deadline
        self.grace = grace
        self.end = time.monotonic() + deadline
        self.results: dict[int, Any] = {}
        self.open_conns = dict(conns)
        self.sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
        self.reached: dict[int, float] = {}
        """Per rank, the highest step it reported (``math.inf`` once its function ended)."""
        self.notes: dict[int, str] = {}
        self.frontier: list[tuple[float, float, int, str]] = []
        """``(step, time, rank, note)`` each time the highest step any rank reached rose."""
        self.started: set[int] = set()
        """The ranks whose function has started (past the rendezvous and the first barrier)."""
        self.last_step: dict[int, int] = {}
        """Per rank, the highest step it reported (a function's end is no step)."""
        self.history: dict[int, dict[int, StepReport]] = {}
        """Per rank and step, what it said when it finished the step (the divergence of a failed run is read here)."""
        self.working: dict[int, tuple[int, StepReport]] = {}
        """Per rank, its last report from inside a step: ``(step, what it had done so far)``."""

    def steps(self) -> dict[int, int | None]:
        """Per rank, the highest step it reported through ``progress`` (None: none)."""
        return {r: self.last_step.get(r) for r in range(len(self.procs))}

    def run(self) -> list[Any]:
        try:
            return self._run()
        except LaunchError as exc:
            self._name_divergence(exc)
            raise

    def _name_divergence(self, exc: LaunchError) -> None:
        """Whatever ended the run, name the rank that left its peers' collectives when the ranks' records show one
        (:mod:`harness.distributed.divergence`), after reading every notice still in the pipes."""
        for conn in list(self.open_conns):
            rank = self.open_conns[conn]
            final = self._take(conn)
            if final is not None and final[0] != "error":
                self.results.setdefault(rank, final[1])
        # A rank killed from outside (SIGKILL: the out-of-memory killer) says nothing about where it was going.
        working = {r: w for r, w in self.working.items() if self.procs[r].exitcode != -signal.SIGKILL}
        found = first_divergence(self.history, len(self.procs), working, settled=exc.kind != "deadline")
        if found is not None:
            exc.name_cause(*found)

    def _run(self) -> list[Any]:
        n = len(self.procs)
        while len(self.results) < n:
            now = time.monotonic()
            if now >= self.end:
                for conn, rank in list(self.open_conns.items()):  # the last notices, for where each rank was
                    final = self._take(conn)
                    if final is not None:
                        self._final(rank, *final)
                alive = [r for r in range(n) if r not in self.results]
                if not alive:
                    break
                stacks = _stacks(self.procs, alive, self.tmp)
                details = {r: (f"({self._position(r)})\n" if r in self.reached else "") + stacks[r]
                           for r in alive}
                summary = (f"deadline of {self.deadline:g} s passed with rank(s) {alive} still running; "
                           "their Python stacks:")
                raise LaunchError("deadline", alive, details, summary)
            wake = min(self.end, self._check_lockstep(now))
            ready = wait([*self.open_conns, *self.sentinels], timeout=max(0.0, wake - now))
            for obj in ready:
                if obj in self.open_conns:
                    rank = self.open_conns[obj]
                    final = self._take(obj)
                    if final is not None:
                        self._final(rank, *final)
            for obj in ready:
                if obj in self.sentinels:
                    self._ended(obj)
        return [self.results[r] for r in range(n)]

    def _conn_of(self, rank: int) -> Connection | None:
        return next((c for c, r in self.open_conns.items() if r == rank), None)

    def _take(self, conn: Connection) -> tuple[str, Any] | None:
        """Read what ``conn`` has now: record progress notices; return the result if it came (and close the pipe to
        further reading); on EOF drop the pipe (the sentinel then reports the death)."""
        rank = self.open_conns[conn]
        for _ in range(10_000):
            try:
                if not conn.poll():
                    return None
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self.open_conns.pop(conn, None)
                return None
            if message[0] == "step":
                self._record(rank, float(message[1]), message[2])
                collectives = message[3] if len(message) > 3 else None
                self.history.setdefault(rank, {})[int(message[1])] = StepReport(message[2], collectives)
            elif message[0] == "within":
                self.working[rank] = (int(message[1]), StepReport(message[2], message[3], finished=False))
            elif message[0] == "done":
                self._record(rank, math.inf, message[1])
            elif message[0] == "started":
                self.started.add(rank)
            else:
                self.open_conns.pop(conn, None)
                return message[0], message[1]
        return None

    def _record(self, rank: int, step: float, note: str) -> None:
        if step != math.inf:
            self.last_step[rank] = max(int(step), self.last_step.get(rank, -1))
        if step <= self.reached.get(rank, -1.0):
            return
        self.reached[rank] = step
        self.notes[rank] = note
        if not self.frontier or step > self.frontier[-1][0]:
            self.frontier.append((step, time.monotonic(), rank, note))

    def _final(self, rank: int, status: str, value: Any) -> None:
        if status != "error":
            self.results[rank] = value
            self._record(rank, math.inf, self.notes.get(rank, "returned"))
            return
        n = len(self.procs)
        # A peer's death often surfaces first as this rank's "Connection closed by peer": report the death, the
        # cause, rather than its echo.
        dead = _dead_peer(self.procs, self.results, rank)
        if dead is not None:
            reason = _exit_reason(self.procs[dead].exitcode)
            self._fail(
                "died", dead, f"{reason}\n(rank {rank} then raised:)\n{value}",
                f"rank {dead} of {n} {reason} before returning a result", also_done=(rank,),
            )
        self._fail("raised", rank, value, f"rank {rank} of {n} raised")

    def _ended(self, sentinel: Any) -> None:
        rank = self.sentinels.pop(sentinel)
        if rank in self.results:
            return
        conn = self._conn_of(rank)
        if conn is not None and conn.poll():
            self.sentinels[sentinel] = rank  # what it sent is waiting in the pipe: read it on the next turn
            return
        self.procs[rank].join(1)
        reason = _exit_reason(self.procs[rank].exitcode)
        self._fail("died", rank, reason, f"rank {rank} of {len(self.procs)} {reason} before returning a result")

    def _check_lockstep(self, now: float) -> float:
        """Raise "desync" if a running rank is more than the grace behind; else the time of the next check."""
        if self.grace is None or len(self.procs) < 2 or not self.frontier:
            return math.inf
        behind: dict[int, tuple[float, float, int, str]] = {}
        wake = math.inf
        for rank, proc in enumerate(self.procs):
            reached = self.reached.get(rank, -1.0)
            if rank in self.results or reached == math.inf or not proc.is_alive():
                continue  # a dead rank is reported by its sentinel, as a death
            first = next((f for f in self.frontier if f[0] > reached), None)
            if first is None:
                continue
            expires = first[1] + self.grace
            if now >= expires:
                behind[rank] = first
            else:
                wake = min(wake, expires)
        if not behind:
            return wake
        step, _, leader, note = min(behind.values())
        laggers = sorted(behind)
        how = f"ended its function ({note})" if step == math.inf else (
            f"finished step {int(step)}" + (f" ({note})" if note else ""))
        summary = f"rank {leader} {how} but rank(s) {laggers} did not within {self.grace:g} s; every rank was stopped"
        details = self._reports(laggers, "behind", always_say_where=True)
        details[leader] = f"{how}; where each rank was: {self._positions()}"
        raise LaunchError("desync", laggers, details, summary, leader=leader)

    def _positions(self) -> str:
        return ", ".join(f"rank {r}: {self._position(r)}" for r in range(len(self.procs)))

    def _position(self, rank: int) -> str:
        reached = self.reached.get(rank)
        note = self.notes.get(rank, "")
        if reached is None:
            return "no step reported"
        if reached == math.inf:
            return f"function ended ({note})"
        return f"last reported step {int(reached)}" + (f" ({note})" if note else "")

    def _reports(self, ranks: Sequence[int], state: str, always_say_where: bool = False) -> dict[int, str]:
        """What each of ``ranks`` has to say: its own error if it has sent one, else its Python stack (where it is
        stuck), headed by ``state`` and the last step it reported."""
        out = {}
        waiting = []
        for rank in ranks:
            conn = self._conn_of(rank)
            final = self._take(conn) if conn is not None else None
            if final is not None and final[0] == "error":
                out[rank] = f"(it failed too)\n{final[1]}"
            elif self.procs[rank].is_alive():
                waiting.append(rank)
        for rank, stack in _stacks(self.procs, waiting, self.tmp).items():
            where = f"; {self._position(rank)}" if rank in self.reached or always_say_where else ""
            out[rank] = f"({state}{where}; its stack)\n{stack}"
        return out

    def _fail(self, kind: str, rank: int, detail: str, summary: str, also_done: Sequence[int] = ()) -> None:
        """Raise ``kind`` for ``rank``, with what each other rank still running has to say."""
        peers = [r for r in range(len(self.procs)) if r != rank and r not in self.results and r not in also_done]
        details = {rank: detail, **self._reports(peers, f"still running when rank {rank} failed")}
        reported = [r for r in peers if r in details]
        summary += "; every rank was stopped" + (f"; also reported: rank(s) {reported}" if reported else "")
        raise LaunchError(kind, [rank, *reported], details, summary)


def _dead_peer(procs: list[Any], results: dict[int, Any], rank: int, grace: float = 0.5) -> int | None:
    """A peer of ``rank`` that ended without a result within ``grace`` seconds, if any."""
    pending = {p.sentinel: r for r, p in enumerate(procs) if r != rank and r not in results}
    if not pending:
        return None
    wait(list(pending), timeout=grace)
    for r in pending.values():
        # A rank only ever exits on its own with status 0, after sending its result (a failed rank waits to be
        # killed); any other ending is a death. (conn.poll() cannot tell: it is also true at EOF of a dead rank.)
        if not procs[r].is_alive() and procs[r].exitcode != 0:
            return r
    return None


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"died from {name}"
    return f"exited with status {code}"


def _stacks(procs: list[Any], ranks: list[int], tmp: str) -> dict[int, str]:
    """Ask each live rank in ``ranks`` for its Python stack (faulthandler on SIGUSR1) and read what it wrote."""
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    paths = {rank: os.path.join(tmp, f"stack-{rank}.txt") for rank in ranks}
    give_up = time.monotonic() + 2.0
    while time.monotonic() < give_up and not all(_nonempty(p) for p in paths.values()):
        time.sleep(0.02)
    time.sleep(0.05)  # let a dump that has started finish
    out = {}
    for rank, path in paths.items():
        try:
            with open(path) as f:
                out[rank] = f.read() or "(no stack written)"
        except OSError:
            out[rank] = "(no stack written)"
    return out


def _nonempty(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(5)
