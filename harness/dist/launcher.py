"""Run a function on W real ranks, with a deadline, and never leave a process behind.

Why it looks the way it does (numbers from FACTS.md, measured on 2-core machines):

* **forkserver with torch preloaded.** A fresh ``spawn`` pays ~4.7 s per launch, nearly all of it imports (the first
  DDP construction alone imports ``torch._dynamo``). A forkserver that imported torch, ``torch.distributed`` and
  ``torch._dynamo`` once forks ranks that are ready in tens of milliseconds. ``fork`` from the test process is faster
  still but hung 2 launches in 10 and cannot use CUDA.
* **A FileStore in a private temporary folder** for the rendezvous: no port to collide on under ``pytest -n auto``.
* **Fail fast.** A rank that raises while its peers sit in a collective leaves them blocked until the process-group
  timeout; so the parent watches every rank's result pipe *and* its process sentinel, and the first unexpected error
  or death kills every rank at once (SIGKILL: SIGTERM does not reliably stop a rank stuck in gloo).
* **A deadline** for the whole run, with the process-group timeout set below it so a stuck collective usually
  surfaces as an error with a traceback; past the deadline the parent asks each live rank for its Python stack
  (``faulthandler`` on SIGUSR1, which works even inside a blocking C call) and kills it.
* **No orphans.** Ranks are children of the forkserver, not of the caller: each rank sets ``PR_SET_PDEATHSIG`` so it
  dies with the forkserver, which itself exits when the calling process goes away.
* **Results as bytes.** A tensor sent over a ``multiprocessing`` pipe travels as a shared-memory file descriptor that
  dies with the rank; results are pickled with plain :mod:`pickle` (tensors by value) and sent as bytes.
* **Leave through ``os._exit``.** A rank that destroys its process group while a DDP module is alive can hang in
  interpreter shutdown; once its result is sent, nothing else it could do matters.
* **Lockstep progress** (``lockstep_grace``). A rank that raises an *expected* exception, or returns early, while its
  peers sit in a collective is no failure the fail-fast path can see: the peers would only give up at the
  process-group timeout, with "timed out" as the message. A rank function that calls :func:`progress` after each
  step lets the parent see the ranks drift apart and stop them all within the grace, naming the rank that moved on
  (with its note) and the ranks left behind (with their stacks).
* **The caller's modules preloaded** (``preload``): the forkserver imports them once; asking for a module the running
  server lacks restarts it with the union of every list asked for so far.
* **The caller's environment at each launch.** The forkserver forks ranks with the environment it had when it
  started; each rank replaces it with the caller's ``os.environ`` as of the launch (then ``env=``), before it imports
  the module of its function.
* **Start-up has its own timeout.** The rendezvous and the first barrier may take as long as the deadline (a late rank
  on a loaded machine); the shorter process-group timeout applies from the first barrier on.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import json
import math
import os
import pickle
import select
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

from harness.dist import _preload

DEFAULT_DEADLINE = 60.0
"""Seconds a whole run may take by default."""

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "harness", "harness.dist.launcher")
"""Modules the forkserver imports once, so that each rank starts warm (``launch(..., preload=...)`` adds more)."""

_PR_SET_PDEATHSIG = 1


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


def progress(step: int, note: str = "") -> None:
    """Tell the launcher that this rank has finished step ``step`` (0, 1, 2, ...; e.g. a training window).

    Called inside a function run by :func:`launch`; elsewhere it does nothing. It never waits for the parent: the
    notice goes into the rank's result pipe if the pipe has room now, else it is kept and sent with the next notice or
    the result (a notice stands for every step up to its own, so only the highest matters). With
    ``launch(..., lockstep_grace=g)``, once one rank has reported a step, every other rank must report it (or return)
    within ``g`` seconds, or the run is stopped as ``"desync"`` and ``note`` (keep it short: it is cut to fit one
    pipe write) is shown as what the leading rank did.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        msg = f"step={step!r} must be a non-negative integer: the index of the step this rank has just finished"
        raise ValueError(msg)
    if not isinstance(note, str):
        msg = f"note={note!r} must be a string (say what the step did, e.g. 'window 0: refused the window')"
        raise TypeError(msg)
    channel = _CHANNEL
    if channel is not None:
        channel.notice(step, note)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    deadline: float = DEFAULT_DEADLINE,
    backend: str = "gloo",
    device: str = "cpu",
    expect: tuple[type[BaseException], ...] = (),
    env: Mapping[str, str] | None = None,
    threads: int = 1,
    lockstep_grace: float | None = None,
    preload: Sequence[str] = (),
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` ranks inside an initialized default process group; return each rank's value.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). An exception of a type in ``expect`` comes
    back as an :class:`Expected` value for that rank instead of failing the run, so "every rank raised ValueError" is
    observable. Anything else a rank raises, a rank's death, or ``deadline`` seconds passing raises
    :class:`LaunchError` after every rank has been killed. ``device="cuda"`` gives rank r the CUDA device
    ``r % device_count`` (``LOCAL_RANK``); each rank's environment is the caller's ``os.environ`` as of this call,
    plus ``env``, plus ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``; ``threads`` sets each
    rank's intra-op thread count (1 keeps W ranks from fighting over a 2-core machine).

    ``lockstep_grace`` (seconds): once any rank has reported step s through :func:`progress`, or has ended its
    function (returned, or raised an expected exception: that counts as every step), every other rank still running
    must report step s or end within the grace; otherwise every rank is killed and :class:`LaunchError` ``"desync"``
    names the ranks left behind, with their stacks, and the leading rank's note. Set it above the longest honest
    imbalance between ranks for one step, counting the work after the last step (a rank's return starts the clock
    for every peer's). None (the default) checks nothing: a rank left in a collective then fails at the
    process-group timeout.

    ``preload``: module names the forkserver imports before it forks the ranks (besides :data:`PRELOAD`), so that a
    recipe's heavy imports are paid once per process rather than once per rank per launch. A module the running
    server lacks makes this launch wait for any other launch of this process to end, then restarts the server with
    every module asked for so far (one cold start). A module that fails to import there is left for each rank to
    import as before.
    """
    _check_launch_args(fn, world_size, deadline, backend, device, expect, threads, env, lockstep_grace, preload)
    # The process group must give up before the launcher does, so that a stuck collective surfaces as an error
    # with a traceback rather than as a kill at the deadline.
    pg_timeout = max(1.0, min(deadline - 1.0, deadline * 0.75))
    # Start-up (rendezvous and first barrier) may use the whole deadline where the process-group timeout can be
    # changed afterwards; a late rank on a loaded machine is not a stuck collective.
    startup_timeout = max(pg_timeout, float(deadline)) if _set_pg_timeout_fn() is not None else pg_timeout
    with _forkserver(tuple(preload)) as ctx:
        environ = dict(os.environ)
        environ.update(env or {})
        tmp = tempfile.mkdtemp(prefix="harness-launch-")
        procs: list[Any] = []
        conns: dict[Connection, int] = {}
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                rank_env = {
                    **environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                    "LOCAL_WORLD_SIZE": str(world_size),
                }
                spec = _RankSpec(rank, world_size, backend, device, pg_timeout, startup_timeout, tmp, rank_env,
                                 expect, threads)
                p = ctx.Process(target=_rank_main, args=(spec, fn, args, writer), name=f"harness-rank{rank}",
                                daemon=True)
                p.start()
                writer.close()
                procs.append(p)
                conns[reader] = rank
            return _Watch(procs, conns, tmp, deadline, lockstep_grace).run()
        finally:
            _kill(procs)
            for c in conns:
                c.close()
            shutil.rmtree(tmp, ignore_errors=True)


def _check_launch_args(
    fn: Any, world_size: Any, deadline: Any, backend: Any, device: Any, expect: Any, threads: Any,
    env: Any = None, lockstep_grace: Any = None, preload: Any = (),
) -> None:
    if not callable(fn):
        msg = f"fn={fn!r} must be a module-level function (it is pickled by reference into each rank)"
        raise TypeError(msg)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        msg = f"world_size={world_size!r} must be a positive integer"
        raise ValueError(msg)
    if not isinstance(deadline, (int, float)) or not deadline > 0:
        msg = f"deadline={deadline!r} must be a positive number of seconds"
        raise ValueError(msg)
    if backend not in ("gloo", "nccl", "cpu:gloo,cuda:nccl"):
        msg = f"backend={backend!r} must be 'gloo', 'nccl' or 'cpu:gloo,cuda:nccl'"
        raise ValueError(msg)
    if device not in ("cpu", "cuda"):
        msg = f"device={device!r} must be 'cpu' or 'cuda'"
        raise ValueError(msg)
    if "nccl" in backend and device != "cuda":
        msg = f"backend={backend!r} needs device='cuda' (NCCL reduces CUDA tensors only)"
        raise ValueError(msg)
    if not isinstance(expect, tuple) or not all(isinstance(e, type) and issubclass(e, BaseException) for e in expect):
        msg = f"expect={expect!r} must be a tuple of exception classes, e.g. (ValueError,)"
        raise TypeError(msg)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        msg = f"threads={threads!r} must be a positive integer"
        raise ValueError(msg)
    if env is not None and (not isinstance(env, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    )):
        msg = f"env={env!r} must map variable names to string values, e.g. {{'HARNESS_FAULT': 'rank=1'}}"
        raise TypeError(msg)
    if lockstep_grace is not None and (
        isinstance(lockstep_grace, bool) or not isinstance(lockstep_grace, (int, float))
        or not 0 < lockstep_grace < math.inf
    ):
        msg = f"lockstep_grace={lockstep_grace!r} must be None or a positive number of seconds, e.g. 2.0"
        raise ValueError(msg)
    if isinstance(preload, str) or not isinstance(preload, Sequence):
        msg = f"preload={preload!r} must be a sequence of module names, e.g. ({preload!r},)"
        raise TypeError(msg)
    for name in preload:
        if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
            msg = f"preload={tuple(preload)!r} holds {name!r}, which is not a module name (dotted identifiers, e.g. " \
                  "'mypackage.recipes')"
            raise ValueError(msg)


# --- the forkserver --------------------------------------------------------------------------------------------------

_SERVER = threading.Condition()
_server_modules: tuple[str, ...] = ()
"""The caller modules the running server was started with (with :data:`PRELOAD` and :mod:`harness.dist._preload`)."""
_server_started = False
_active_launches = 0
_restarting = False
_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD, _preload.__name__])
        _CONTEXT = ctx
    return _CONTEXT


@contextlib.contextmanager
def _forkserver(preload: tuple[str, ...]) -> Iterator[Any]:
    """The forkserver context, with a server running that has preloaded ``preload``; while it is held, no other
    launch of this process restarts the server (which would kill this launch's ranks with it)."""
    global _active_launches, _restarting, _server_modules, _server_started
    ctx = _context()
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    with _SERVER:
        while _restarting:
            _SERVER.wait()
        missing = [m for m in dict.fromkeys(preload) if m not in _server_modules]
        if missing and _server_started and _can_stop(server):
            _restarting = True
            try:
                while _active_launches:
                    _SERVER.wait()
                _stop_server(server)
                _server_modules = (*_server_modules, *missing)
            finally:
                _restarting = False
                _SERVER.notify_all()
        elif missing and not _server_started:
            _server_modules = (*_server_modules, *missing)
        # (Re)start it if it is not running, naming the caller's modules to the server's harness.dist._preload.
        path = [p for p in sys.path if isinstance(p, str)]
        os.environ[_preload.ENV] = json.dumps({"modules": list(_server_modules), "sys_path": path})
        try:
            server.ensure_running()
        finally:
            os.environ.pop(_preload.ENV, None)
        _server_started = True
        _active_launches += 1
    try:
        yield ctx
    finally:
        with _SERVER:
            _active_launches -= 1
            _SERVER.notify_all()


def _can_stop(server: Any) -> bool:
    return all(hasattr(server, a) for a in ("_lock", "_forkserver_pid", "_forkserver_alive_fd", "_forkserver_address"))


def _stop_server(server: Any, within: float = 10.0) -> None:
    """Stop the running forkserver (CPython's ``ForkServer._stop``, with a bound on the wait): it exits when its
    "alive" pipe closes; each rank closed its own copy as it started, and no launch is running."""
    from multiprocessing import util

    with server._lock:
        pid = server._forkserver_pid
        if pid is None:
            return
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
        end = time.monotonic() + within
        try:
            while not os.waitpid(pid, os.WNOHANG)[0]:
                if time.monotonic() > end:
                    # Something else still holds the pipe (a process it forked outside this launcher).
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
        except ChildProcessError:
            pass  # reaped already
        server._forkserver_pid = None
        address = server._forkserver_address
        if address is not None and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        server._forkserver_address = None


def _set_pg_timeout_fn() -> Callable[..., None] | None:
    """torch's setter of a process group's default timeout (``_set_pg_timeout``, private), or None without it."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:
        return None
    return _set_pg_timeout  # type: ignore[no-any-return,unused-ignore]


# --- the rank side ---------------------------------------------------------------------------------------------------


def _spec_in_rank(fields: dict[str, Any]) -> _RankSpec:
    """Unpickle a spec in the rank, replacing the process environment with the spec's first: the spec is unpickled
    before ``fn``, so a module first imported to unpickle ``fn`` sees the caller's environment too."""
    os.environ.clear()
    os.environ.update(fields["environ"])
    return _RankSpec(**fields)


@dataclass(frozen=True)
class _RankSpec:
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
        self._pending: tuple[int, bytes] | None = None
        self._pid = os.getpid()

    def notice(self, step: int, note: str) -> None:
        if os.getpid() != self._pid:
            return  # a process forked by the rank's function: the pipe is the rank's
        frame = _frame(("step", step, note))
        limit = getattr(select, "PIPE_BUF", 512)
        while len(frame) > limit:
            note = note.encode()[: max(0, len(note.encode()) - (len(frame) - limit) - 8)].decode(errors="ignore")
            frame = _frame(("step", step, note + " ..."))
        with self._lock:
            if self._pending is None or step >= self._pending[0]:
                self._pending = (step, frame)
            with contextlib.suppress(OSError):
                self._flush(block=False)

    def send(self, message: tuple[Any, ...] | bytes) -> None:
        """Send ``message`` (pickled here unless it is bytes already), after any notice still waiting; blocks."""
        payload = message if isinstance(message, bytes) else pickle.dumps(message)
        with self._lock:
            self._flush(block=True)
            self._conn.send_bytes(payload)

    def _flush(self, block: bool) -> None:
        if self._pending is None:
            return
        frame = self._pending[1]
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
        self._pending = None


def _frame(message: tuple[Any, ...]) -> bytes:
    payload = pickle.dumps(message)
    return struct.pack("!i", len(payload)) + payload


_CHANNEL: _Channel | None = None
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


def _rank_main(spec: _RankSpec, fn: Callable[..., Any], args: tuple[Any, ...], conn: Connection) -> None:
    global _CHANNEL
    _die_with_parent()
    stack_file = open(os.path.join(spec.tmp, f"stack-{spec.rank}.txt"), "w")  # noqa: SIM115 (lives until exit)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    channel = _CHANNEL = _Channel(conn)
    message: tuple[str, Any]
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec.threads)
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
        set_timeout = _set_pg_timeout_fn()
        if spec.startup_timeout != spec.pg_timeout and set_timeout is not None:
            set_timeout(datetime.timedelta(seconds=spec.pg_timeout))
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


# --- the parent side -------------------------------------------------------------------------------------------------


class _Watch:
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

    def run(self) -> list[Any]:
        n = len(self.procs)
        while len(self.results) < n:
            now = time.monotonic()
            if now >= self.end:
                alive = [r for r in range(n) if r not in self.results]
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
            elif message[0] == "done":
                self._record(rank, math.inf, message[1])
            else:
                self.open_conns.pop(conn, None)
                return message[0], message[1]
        return None

    def _record(self, rank: int, step: float, note: str) -> None:
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


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(5)
