"""Run a function on W real ranks, with a deadline, and never leave a process behind.

Why it looks the way it does:

* **forkserver with torch preloaded.** A fresh ``spawn`` pays seconds per launch, nearly all of it imports (the first
  DDP construction alone imports ``torch._dynamo``). A forkserver that imported torch, ``torch.distributed`` and
  ``torch._dynamo`` once forks ranks that are ready in tens of milliseconds: ``benchmarks/launch_bench.py`` measures
  both for one 2-rank DDP step (``benchmarks/results/launch.json``). ``fork`` from the test process is faster still
  but hangs some launches and cannot use CUDA.
* **A FileStore in a private temporary folder** for the rendezvous: no port to collide on under ``pytest -n auto``.
  The folder is named after the calling process and its start time, and the next launch removes any whose caller has
  ended (:mod:`harness.distributed.scratch`).
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
  on a loaded machine); from the first barrier on, the process-group timeout is the shorter one, cut further to what
  start-up left of the deadline (less the margin), so a stuck collective still raises before the deadline fires.

* **What the ranks print, once.** Each rank's file descriptors 1 and 2 point at a file of its own in the launch's
  folder (the ones it inherits are the forkserver's, the caller's as of the server's start); when the launch ends the
  lines are relayed to the caller's stderr once, each prefixed with the ranks that printed it, so W ranks' copies of
  one warning read as one line (:mod:`.output`). A rank that died without a traceback has its last lines (gloo's
  "collective mismatch") put into its details.

The parts: this module (the public :func:`launch` and :func:`progress`, argument checks), :mod:`.forkserver` (the
server, its preload and restart), :mod:`.rank` (what runs in a rank), :mod:`.watch` (the parent's watch loop: results,
deaths, lockstep, deadline), :mod:`.errors` (:class:`LaunchError`, :class:`Expected`), :mod:`.scratch` (each launch's
folder), :mod:`.output` (the ranks' output: capture, merge, relay).
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from harness.core.validate import positive_int
from harness.distributed import forkserver, output, rank, scratch, watch
from harness.distributed.errors import Expected, LaunchError
from harness.distributed.forkserver import PRELOAD

__all__ = ["DEFAULT_DEADLINE", "PRELOAD", "Expected", "LaunchError", "Results", "launch", "launches", "progress",
           "warm"]

DEFAULT_DEADLINE = 60.0
"""Seconds a whole run may take by default."""

_LAUNCHES = [0]


def warm(*modules: str) -> None:
    """Import ``modules`` in the forkserver when it starts, as if a launch had asked for them with ``preload=``: call
    it before the first launch of a process that will launch with many modules' functions (a test session), and the
    server starts once, warm, instead of restarting cold for each new module."""
    bad = [m for m in modules if not isinstance(m, str) or not all(p.isidentifier() for p in m.split("."))]
    if bad:
        msg = f"modules={bad!r} must be module names (e.g. 'mypkg.recipes')"
        raise ValueError(msg)
    forkserver.warm(tuple(modules))


def launches() -> int:
    """How many launches this process has started (valid arguments, whatever their outcome): what a run cache saves
    shows here (``benchmarks/suite_bench.py`` counts them per test)."""
    return _LAUNCHES[0]


def progress(step: int, note: str = "", *, collectives: int | None = None, finished: bool = True) -> None:
    """Tell the launcher that this rank has finished step ``step`` (0, 1, 2, ...; e.g. a training window).

    Called inside a function run by :func:`launch`; elsewhere it does nothing. It never waits for the parent: the
    notice goes into the rank's result pipe if the pipe has room now, else it is kept and sent with the next notice or
    the result (a notice stands for every step up to its own, so only the highest matters). With
    ``launch(..., lockstep_grace=g)``, once one rank has reported a step, every other rank must report it (or return)
    within ``g`` seconds, or the run is stopped as ``"desync"`` and ``note`` (keep it short: it is cut to fit one
    pipe write) is shown as what the leading rank did.

    ``collectives``: how many of the collectives every rank must run together this rank ran in the step (the battery
    passes its gradient synchronizations). When the run fails, whatever ends it, the ranks' counts are compared step
    by step: a rank that finished a step with another count than its peers, or with none while its peers never
    finished it, is named as the cause, with its ``note`` (then written as a phrase: ``"skipped the backward of
    window 3"``; :mod:`harness.distributed.divergence`).

    ``finished=False``: the rank is still in step ``step``, and ``note`` and ``collectives`` say what it has done so far
    (the collectives it has begun). Not a step reached (the lockstep grace ignores it); read only when the run fails
    before the step's end, where no finished record tells the ranks apart (a rank that skipped a collective and died
    in gloo's mismatch, or NCCL's watchdog, inside the step). Send ``collectives=None`` when the step ends in an
    exception of the rank's own code: then nobody is named, and that exception is the cause.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        msg = f"step={step!r} must be a non-negative integer: the index of the step this rank has just finished"
        raise ValueError(msg)
    if not isinstance(note, str):
        msg = f"note={note!r} must be a string (say what the step did, e.g. 'window 0: refused the window')"
        raise TypeError(msg)
    if collectives is not None and (isinstance(collectives, bool) or not isinstance(collectives, int)
                                    or collectives < 0):
        msg = f"collectives={collectives!r} must be None or a non-negative count of the collectives run in the step"
        raise ValueError(msg)
    channel = rank.CHANNEL
    if channel is not None:
        channel.notice(step, note, collectives, finished=finished)


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
    relay_output: bool = True,
    nodes: int = 1,
) -> Results:
    """Call ``fn(*args)`` on ``world_size`` ranks inside an initialized default process group; return each rank's value.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). An exception of a type in ``expect`` comes
    back as an :class:`Expected` value for that rank instead of failing the run, so "every rank raised ValueError" is
    observable. Anything else a rank raises, a rank's death, or ``deadline`` seconds passing raises
    :class:`LaunchError` after every rank has been killed. ``device="cuda"`` gives rank r the CUDA device
    ``r % device_count`` (``LOCAL_RANK`` on one node); each rank's environment is the caller's ``os.environ`` as of
    this call, plus ``env``, plus ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``
    (one node unless ``nodes``); ``threads`` sets each rank's intra-op thread count (1 keeps W ranks from fighting
    over a 2-core machine).

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

    What the ranks print (stdout and stderr, Python's and C++'s alike, warnings included) is captured per rank and,
    with ``relay_output`` (the default), written to the caller's ``sys.stderr`` once when the launch ends, returned
    or failed: a line several ranks printed once, prefixed with their ranks (``[ranks 0,1] UserWarning: ...``), at
    most 200 distinct lines (:mod:`harness.distributed.output`). Either way each rank's whole text comes back as
    ``.output`` (rank -> text, ranks that printed nothing left out) of the returned list or of the
    :class:`LaunchError`.

    ``nodes``: how many nodes the ranks' environment says they are spread over, as torchrun would set it for
    ``nodes`` nodes of ``world_size // nodes`` consecutive ranks each: ``LOCAL_WORLD_SIZE`` ``world_size // nodes``,
    ``LOCAL_RANK`` ``r % LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node) ``r // LOCAL_WORLD_SIZE``. Only the
    environment changes (every rank still runs here, and ``device="cuda"`` still gives rank r device
    ``r % device_count``): it lets code that builds node-local groups from those variables run as on several nodes.
    It must divide ``world_size``.
    """
    _check_launch_args(fn, world_size, deadline, backend, device, expect, threads, env, lockstep_grace, preload)
    local_world = _local_world_size(world_size, nodes)
    _LAUNCHES[0] += 1
    if not isinstance(relay_output, bool):
        msg = f"relay_output={relay_output!r} must be True (print the ranks' output once) or False (only return it)"
        raise TypeError(msg)
    # The process group must give up before the launcher does, so that a stuck collective surfaces as an error
    # with a traceback rather than as a kill at the deadline.
    pg_timeout = rank.collective_timeout(deadline)
    # Start-up (rendezvous and first barrier) may use the whole deadline where the process-group timeout can be
    # changed afterwards; a late rank on a loaded machine is not a stuck collective.
    startup_timeout = max(pg_timeout, float(deadline)) if rank.set_pg_timeout_fn() is not None else pg_timeout
    # The function and its arguments are pickled once, with plain pickle (tensors by value), for every rank: through
    # multiprocessing's own pickler, torch would move each tensor through a shared-memory segment, per rank.
    call = pickle.dumps((fn, args))
    with forkserver.running(tuple(preload)) as ctx:
        ends_at = time.time() + deadline
        environ = dict(os.environ)
        environ.update(env or {})
        tmp = scratch.make()
        failure: LaunchError | None = None
        procs: list[Any] = []
        conns: dict[Connection, int] = {}
        try:
            for r in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                rank_env = {
                    **environ, "RANK": str(r), "LOCAL_RANK": str(r % local_world), "WORLD_SIZE": str(world_size),
                    "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(r // local_world),
                }
                spec = rank.RankSpec(r, world_size, backend, device, pg_timeout, startup_timeout, tmp, rank_env,
                                     expect, threads, ends_at, caller=os.getpid())
                # Not daemonic: a daemonic process may not start children, and a rank's code may (a DataLoader's
                # workers). Its life is still tied to the caller's: PR_SET_PDEATHSIG to the forkserver, which ends
                # with the caller, and every rank is killed and joined before launch returns.
                p = ctx.Process(target=rank.rank_main, args=(spec, call, writer), name=f"harness-rank{r}",
                                daemon=False)
                p.start()
                writer.close()
                procs.append(p)
                conns[reader] = r
            watcher = watch.Watch(procs, conns, tmp, deadline, lockstep_grace)
            try:
                results = Results(watcher.run())
            except LaunchError as exc:
                exc.progress, exc.started, exc.deadline = watcher.steps(), tuple(sorted(watcher.started)), deadline
                failure = exc
        finally:
            watch.kill(procs)
            for c in conns:
                c.close()
            texts = output.read(tmp, world_size)
            shutil.rmtree(tmp, ignore_errors=True)
            if relay_output:
                output.relay(texts)
    if failure is not None:
        failure.attach_output(texts, output.last_lines)
        raise failure
    results.output = texts
    return results


class Results(list[Any]):
    """What :func:`launch` returns: each rank's value, in rank order, and ``output``: each rank's captured stdout and
    stderr (rank -> text; a rank that printed nothing is left out)."""

    output: dict[int, str]

    def __init__(self, values: Sequence[Any] = ()) -> None:
        super().__init__(values)
        self.output = {}


def _local_world_size(world_size: int, nodes: Any) -> int:
    """The ranks per node of ``world_size`` ranks over ``nodes`` nodes; ValueError naming ``nodes`` unless it is a
    positive divisor of ``world_size``."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or world_size % nodes:
        msg = (f"nodes={nodes!r} must be a positive number of nodes that divides world_size={world_size} (each node "
               "holds world_size // nodes consecutive ranks)")
        raise ValueError(msg)
    return world_size // nodes


def _check_launch_args(
    fn: Any, world_size: Any, deadline: Any, backend: Any, device: Any, expect: Any, threads: Any,
    env: Any = None, lockstep_grace: Any = None, preload: Any = (),
) -> None:
    if not callable(fn):
        msg = f"fn={fn!r} must be a module-level function (it is pickled by reference into each rank)"
        raise TypeError(msg)
    positive_int("world_size", world_size)
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
    positive_int("threads", threads)
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

