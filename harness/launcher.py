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
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

DEFAULT_DEADLINE = 60.0
"""Seconds a whole run may take by default."""

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "harness")
"""Modules the forkserver imports once, so that each rank starts warm."""

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Expected:
    """An exception a rank raised that the caller declared expected (``launch(..., expect=(ValueError,))``)."""

    type: str
    message: str

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


class LaunchError(RuntimeError):
    """A multi-rank run failed: a rank raised, died, or outlived the deadline.

    ``kind`` is ``"raised"``, ``"died"`` or ``"deadline"``; ``ranks`` names the ranks at fault; ``details`` maps
    each of them to its traceback, exit reason or stack.
    """

    def __init__(self, kind: str, ranks: Sequence[int], details: Mapping[int, str], summary: str) -> None:
        self.kind = kind
        self.ranks = tuple(ranks)
        self.details = dict(details)
        parts = [summary]
        for rank in self.ranks:
            parts.append(f"--- rank {rank} ---\n{self.details.get(rank, '(nothing reported)').rstrip()}")
        super().__init__("\n".join(parts))


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
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` ranks inside an initialized default process group; return each rank's value.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). An exception of a type in ``expect`` comes
    back as an :class:`Expected` value for that rank instead of failing the run, so "every rank raised ValueError" is
    observable. Anything else a rank raises, a rank's death, or ``deadline`` seconds passing raises
    :class:`LaunchError` after every rank has been killed. ``device="cuda"`` gives rank r the CUDA device
    ``r % device_count`` (``LOCAL_RANK``); ``env`` adds environment variables in every rank; ``threads`` sets each
    rank's intra-op thread count (1 keeps W ranks from fighting over a 2-core machine).
    """
    _check_launch_args(fn, world_size, deadline, backend, device, expect, threads)
    # The process group must give up before the launcher does, so that a stuck collective surfaces as an error
    # with a traceback rather than as a kill at the deadline.
    pg_timeout = max(1.0, min(deadline - 1.0, deadline * 0.75))
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="harness-launch-")
    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            spec = _RankSpec(rank, world_size, backend, device, pg_timeout, tmp, dict(env or {}), expect, threads)
            p = ctx.Process(target=_rank_main, args=(spec, fn, args, writer), name=f"harness-rank{rank}", daemon=True)
            p.start()
            writer.close()
            procs.append(p)
            conns[reader] = rank
        return _collect(procs, conns, time.monotonic() + deadline, deadline, tmp)
    finally:
        _kill(procs)
        for c in conns:
            c.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _check_launch_args(
    fn: Any, world_size: Any, deadline: Any, backend: Any, device: Any, expect: Any, threads: Any
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


_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _CONTEXT = ctx
    return _CONTEXT


@dataclass(frozen=True)
class _RankSpec:
    rank: int
    world_size: int
    backend: str
    device: str
    pg_timeout: float
    tmp: str
    env: dict[str, str]
    expect: tuple[type[BaseException], ...]
    threads: int


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
    _die_with_parent()
    stack_file = open(os.path.join(spec.tmp, f"stack-{spec.rank}.txt"), "w")  # noqa: SIM115 (lives until exit)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(spec.env)
    os.environ.update(
        RANK=str(spec.rank), LOCAL_RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
    )
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
            timeout=datetime.timedelta(seconds=spec.pg_timeout),
        )
        # Every rank must have connected before any may leave: a rank that exits while a peer is still inside
        # init_process_group breaks the peer's connection ("Connection closed by peer").
        dist.barrier()
        try:
            message = ("ok", fn(*args))
        except spec.expect as exc:
            message = ("ok", Expected(type(exc).__name__, str(exc)))
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
        conn.send_bytes(payload)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if message[0] == "error":
            # Stay until the parent kills us: exiting would close our connections, and peers blocked in a collective
            # would fail with "Connection closed by peer" before the parent could read where they were stuck.
            time.sleep(spec.pg_timeout * 4 + 60)
        os._exit(0)


def _collect(procs: list[Any], conns: dict[Connection, int], end: float, deadline: float, tmp: str) -> list[Any]:
    results: dict[int, Any] = {}
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    open_conns = dict(conns)
    while len(results) < len(procs):
        remaining = end - time.monotonic()
        if remaining <= 0:
            alive = [r for r, p in enumerate(procs) if r not in results]
            stacks = _stacks(procs, alive, tmp)
            summary = f"deadline of {deadline:g} s passed with rank(s) {alive} still running; their Python stacks:"
            raise LaunchError("deadline", alive, stacks, summary)
        ready = wait([*open_conns, *sentinels], timeout=remaining)
        for obj in ready:
            if obj in open_conns:
                rank = open_conns.pop(obj)  # type: ignore[call-overload,unused-ignore]
                try:
                    status, value = pickle.loads(obj.recv_bytes())  # type: ignore[union-attr,unused-ignore]
                except EOFError:
                    continue  # the rank died before sending: its sentinel reports it
                if status == "error":
                    # A peer's death often surfaces first as this rank's "Connection closed by peer": report the
                    # death, the cause, rather than its echo.
                    dead = _dead_peer(procs, results, open_conns, rank)
                    if dead is not None:
                        reason = _exit_reason(procs[dead].exitcode)
                        _fail_with_peers(procs, {**results, rank: None}, open_conns, tmp, "died", dead,
                                         f"{reason}\n(rank {rank} then raised:)\n{value}",
                                         f"rank {dead} of {len(procs)} {reason} before returning a result")
                    _fail_with_peers(procs, results, open_conns, tmp, "raised", rank, value,
                                     f"rank {rank} of {len(procs)} raised")
                results[rank] = value
        for obj in ready:
            if obj in sentinels:
                rank = sentinels.pop(obj)  # type: ignore[call-overload,unused-ignore]
                if rank in results:
                    continue
                conn = next((c for c, r in open_conns.items() if r == rank), None)
                if conn is not None and conn.poll():
                    sentinels[obj] = rank  # its result is waiting in the pipe: read it on the next turn
                    continue
                procs[rank].join(1)
                reason = _exit_reason(procs[rank].exitcode)
                summary = f"rank {rank} of {len(procs)} {reason} before returning a result"
                _fail_with_peers(procs, results, open_conns, tmp, "died", rank, reason, summary)
    return [results[r] for r in range(len(procs))]


def _dead_peer(procs: list[Any], results: dict[int, Any], open_conns: dict[Connection, int], rank: int,
               grace: float = 0.5) -> int | None:
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


def _fail_with_peers(procs: list[Any], results: dict[int, Any], open_conns: dict[Connection, int], tmp: str, kind: str,
                     rank: int, detail: str, summary: str) -> None:
    """Raise for ``rank``'s failure, with what each peer still running has to say: its own error if it has already
    sent one, else its Python stack (where it was stuck)."""
    details = {rank: detail}
    peers = [r for r in range(len(procs)) if r != rank and r not in results]
    waiting = []
    for peer in peers:
        conn = next((c for c, r in open_conns.items() if r == peer), None)
        if conn is not None and conn.poll():
            with contextlib.suppress(EOFError, OSError):
                status, value = pickle.loads(conn.recv_bytes())
                if status == "error":
                    details[peer] = f"(it failed too)\n{value}"
                    continue
        if procs[peer].is_alive():
            waiting.append(peer)
    for peer, stack in _stacks(procs, waiting, tmp).items():
        details[peer] = f"(still running when rank {rank} failed; its stack)\n{stack}"
    reported = [r for r in peers if r in details]
    summary += "; every rank was stopped" + (f"; also reported: rank(s) {reported}" if reported else "")
    raise LaunchError(kind, [rank, *reported], details, summary)


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
