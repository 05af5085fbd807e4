"""The launcher's forkserver: one server per calling process, with torch and the caller's modules preloaded.

Asking for a module the running server lacks restarts it with the union of every list asked for so far, once no
launch of this process is using it (a restart would kill that launch's ranks). See :mod:`harness.distributed.launcher`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.multiprocessing as mp

PRELOADER = "harness.distributed._preload"
"""The module the server imports last, which imports the caller's modules (named in :data:`PRELOAD_ENV`). Named, not
imported here: importing it runs it, and it must run after :data:`PRELOAD`, once the launcher it may lead back to (the
battery's rank program imports it) is whole."""

PRELOAD_ENV = "HARNESS_LAUNCH_PRELOAD"
"""The server's environment variable that names the caller's modules and ``sys.path`` (JSON)."""

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "harness",
           "harness.distributed.launcher", "harness.distributed.rank")
"""Modules the forkserver imports once, so that each rank starts warm (``launch(..., preload=...)`` adds more)."""

_SERVER = threading.Condition()
_server_modules: tuple[str, ...] = ()
"""The caller modules the running server was started with (with :data:`PRELOAD` and
:mod:`harness.distributed._preload`)."""
_server_started = False
_active_launches = 0
_restarting = False
_CONTEXT: Any = None
_starts = [0]


def starts() -> int:
    """How many times this process has started (or restarted) its server: each is a cold start of seconds."""
    return _starts[0]


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD, PRELOADER])
        _CONTEXT = ctx
    return _CONTEXT


@contextlib.contextmanager
def running(preload: tuple[str, ...]) -> Iterator[Any]:
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
        # (Re)start it if it is not running, naming the caller's modules to the server's harness.distributed._preload.
        path = [p for p in sys.path if isinstance(p, str)]
        os.environ[PRELOAD_ENV] = json.dumps({"modules": list(_server_modules), "sys_path": path})
        try:
            if not _alive(server):
                _starts[0] += 1
            server.ensure_running()
        finally:
            os.environ.pop(PRELOAD_ENV, None)
        _server_started = True
        _active_launches += 1
    try:
        yield ctx
    finally:
        with _SERVER:
            _active_launches -= 1
            _SERVER.notify_all()


def warm(modules: tuple[str, ...]) -> None:
    """Have the server import ``modules`` too when it (re)starts: called before a process's first launch, a
    session that will ask for many modules starts its server once with all of them instead of restarting it for each
    new one (each restart is a cold start). A server already running keeps its modules until its next restart."""
    global _server_modules
    with _SERVER:
        _server_modules = tuple(dict.fromkeys((*_server_modules, *modules)))


def _alive(server: Any) -> bool:
    return getattr(server, "_forkserver_pid", None) is not None


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

