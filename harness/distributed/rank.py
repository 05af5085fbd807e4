"""What runs in a rank: the spec it is started with, its pipe to the parent, and its main function.

A rank ties its life to the forkserver's (``PR_SET_PDEATHSIG``), joins the process group through a FileStore in the
launch's folder, runs the caller's function, reports the result as pickled bytes and leaves through ``os._exit``.
See :mod:`harness.distributed.launcher` for why.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from harness.distributed import output
from harness.distributed.errors import Expected

_PR_SET_PDEATHSIG = 1


def set_pg_timeout_fn() -> Callable[..., None] | None:
    """torch's setter of a process group's default timeout (``_set_pg_timeout``, private), or None without it."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:
        return None
    return _set_pg_timeout  # type: ignore[no-any-return,unused-ignore]



def _spec_in_rank(fields: dict[str, Any]) -> RankSpec:
    """Unpickle a spec in the rank, replacing the process environment with the spec's first: the spec is unpickled
    before ``fn``, so a module first imported to unpickle ``fn`` sees the caller's environment too. Its output goes to
    the rank's own file from here on, for the same reason (:mod:`harness.distributed.output`: the file descriptors a
    rank inherits are the forkserver's)."""
    if os.getpid() != fields["caller"]:  # a launched rank, never the caller unpickling a spec
        output.capture(fields["tmp"], fields["rank"])
    os.environ.clear()
    os.environ.update(fields["environ"])
    return RankSpec(**fields)


def collective_timeout(seconds_left: float, floor: float = 1.0) -> float:
    """The process-group timeout for a run with ``seconds_left`` before its deadline: below it by a quarter or a
    second, whichever is less, so that a stuck collective raises (with a traceback) before the launcher must kill."""
    return max(floor, min(seconds_left - 1.0, seconds_left * 0.75))


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    backend: str
    device: str
    pg_timeout: float
    startup_timeout: float
    tmp: str
    environ: dict[str, str]
    expect: tuple[type[BaseException], ...]
    threads: int
    ends_at: float = float("inf")
    """Wall-clock time (``time.time()``) at which the launcher's deadline passes."""
    caller: int = 0
    """The launching process's pid."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_spec_in_rank, (dict(self.__dict__),))


class _Channel:
    """The rank's end of its pipe to the parent: progress notices that never wait, then the final result.

    A notice is one frame in ``multiprocessing.Connection``'s format (a 4-byte length, then the pickle), written in a
    single non-blocking ``write`` of at most ``PIPE_BUF`` bytes, which a pipe takes whole or not at all.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[int, bytes]] = {}
        """The newest notice of each kind not yet written (``"step"``: a step finished; ``"within"``: a rank still in
        one), written finished steps first."""
        self._pid = os.getpid()

    def notice(self, step: int, note: str, collectives: int | None = None, *, finished: bool = True) -> None:
        if os.getpid() != self._pid:
            return  # a process forked by the rank's function: the pipe is the rank's
        kind = "step" if finished else "within"
        frame = _frame((kind, step, note, collectives))
        limit = getattr(select, "PIPE_BUF", 512)
        while len(frame) > limit:
            note = note.encode()[: max(0, len(note.encode()) - (len(frame) - limit) - 8)].decode(errors="ignore")
            frame = _frame((kind, step, note + " ...", collectives))
        with self._lock:
            held = self._pending.get(kind)
            if held is None or step >= held[0]:
                self._pending[kind] = (step, frame)
            with contextlib.suppress(OSError):
                self._flush(block=False)

    def send(self, message: tuple[Any, ...] | bytes) -> None:
        """Send ``message`` (pickled here unless it is bytes already), after any notice still waiting; blocks."""
        payload = message if isinstance(message, bytes) else pickle.dumps(message)
        with self._lock:
            self._flush(block=True)
            self._conn.send_bytes(payload)

    def _flush(self, block: bool) -> None:
        for kind in ("step", "within"):
            if kind not in self._pending:
                continue
            frame = self._pending[kind][1]
            fd = self._conn.fileno()
            if not block:
                os.set_blocking(fd, False)
                try:
                    written = os.write(fd, frame)
                except BlockingIOError:
                    return  # the pipe is full: the parent is busy; try again with the next notice
                finally:
                    os.set_blocking(fd, True)
                frame = frame[written:]  # empty: a write of at most PIPE_BUF bytes is all or nothing
            while frame:
                frame = frame[os.write(fd, frame):]
            del self._pending[kind]


def _frame(message: tuple[Any, ...]) -> bytes:
    payload = pickle.dumps(message)
    return struct.pack("!i", len(payload)) + payload


CHANNEL: _Channel | None = None
"""This rank's pipe to the parent (None outside a launched rank)."""


def _die_with_parent() -> None:
    """Tie this process's life to its parent's (the forkserver), so that nothing outlives a killed caller."""
    # The forkserver exits when every holder of its "alive" pipe is gone, and it hands that pipe to each child it
    # forks. A rank holding it would keep the forkserver alive, and the forkserver the rank: close our copy.
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        server._forkserver_alive_fd = None
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died before prctl took effect: then we were re-parented already.
    if os.getppid() == 1:
        os._exit(1)


def rank_main(spec: RankSpec, call: bytes, conn: Connection) -> None:
    global CHANNEL
    _die_with_parent()
    stack_file = open(os.path.join(spec.tmp, f"stack-{spec.rank}.txt"), "w")  # noqa: SIM115 (lives until exit)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    channel = CHANNEL = _Channel(conn)
    message: tuple[str, Any]
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec.threads)
        # Part of start-up (the rendezvous waits for it): unpickling imports the function's module, in the caller's
        # environment, which is this process's by now (see RankSpec).
        fn, args = pickle.loads(call)
        if spec.device == "cuda":
            torch.cuda.set_device(spec.rank % torch.cuda.device_count())
        store = dist.FileStore(os.path.join(spec.tmp, "store"), spec.world_size)
        dist.init_process_group(
            spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.startup_timeout),
        )
        # Every rank must have connected before any may leave: a rank that exits while a peer is still inside
        # init_process_group breaks the peer's connection ("Connection closed by peer").
        dist.barrier()
        set_timeout = set_pg_timeout_fn()
        if set_timeout is not None:
            # Start-up took part of the deadline: the collectives get what is left of it, less the margin, so that
            # a slow start on a loaded machine does not let the deadline fire before a stuck collective raises.
            timeout = min(spec.pg_timeout, collective_timeout(spec.ends_at - time.time(), floor=0.5))
            if timeout != spec.startup_timeout:
                set_timeout(datetime.timedelta(seconds=timeout))
        channel.send(("started", ""))  # start-up is over: a deadline from here on ran out in the function
        try:
            message = ("ok", fn(*args))
            ended = "returned"
        except spec.expect as exc:
            expected = Expected(type(exc).__name__, str(exc))
            message = ("ok", expected)
            ended = f"raised {expected}"
        # The parent learns that this rank's function has ended before it waits for its peers below: with a
        # lockstep grace, a peer that does not follow is found out within the grace.
        channel.send(("done", ended[:2000]))
        # And none may leave while a peer may still be reading its last sends. A rank that skipped a collective
        # is still found out: its peers then wait here alone, past the process-group timeout.
        try:
            dist.barrier()
        except BaseException:
            message = ("error", "this rank returned, but its peers never reached the end of the run (a peer is stuck, "
                       "or skipped or added a collective):\n" + traceback.format_exc())
    except BaseException:
        message = ("error", traceback.format_exc())
    try:
        payload = pickle.dumps(message)
    except Exception:
        payload = pickle.dumps(("error", f"the result could not be pickled:\n{traceback.format_exc()}"))
    try:
        channel.send(payload)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if message[0] == "error":
            # Stay until the parent kills us: exiting would close our connections, and peers blocked in a collective
            # would fail with "Connection closed by peer" before the parent could read where they were stuck.
            time.sleep(spec.startup_timeout * 4 + 60)
        os._exit(0)

