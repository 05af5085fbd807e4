"""One leg of the resume battery on every rank: build the user's trainer, resume from the newest valid checkpoint of
the run directory (if asked), step to ``end``, checkpoint every ``every`` steps through the harness's commit, and
return each rank's final state, global generators, losses and the checkpoints it wrote.

The harness wraps the trainer's ``save``: it makes the step directory (and fsyncs the run directory above it), calls
``save`` on every rank, gathers each rank's ``state()["step"]`` (its data position), and only then writes the
manifest that makes the folder a complete checkpoint. A kill can land at each of :data:`KILL_POINTS`; a kill inside
the step is placed by a global forward pre-hook, so it interrupts the trainer's own computation; a kill before the
commit lands inside the manifest's write, with half of it on disk.

Processes a loop starts (``DataLoader`` workers) die with their rank: each process forked from a rank asks for
SIGKILL when the rank dies (``PR_SET_PDEATHSIG``, as the rank itself does towards the launcher), and a leg that ends
stops the ones still running before it returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.resume import checkpoint
from harness.resume.checkpoint import LAYOUT_TRAINER, begin_step_dir, check_step_dir, commit_step_dir
from harness.resume.contract import Trainer, check_state, load_trainer
from harness.resume.faults import Fault, die_at
from harness.resume.generators import apply_deterministic, draw_globals, global_states, seed_globals
from harness.resume.options import KILL_POINTS
from harness.resume.state import cpu_copy


class ResumeMismatch(ValueError):
    """What a rank found wrong with a resume before any comparison: a checkpoint whose labels disagree, a trainer
    whose step after ``load`` is not the checkpoint's, no checkpoint to resume from."""


@dataclass(frozen=True)
class Leg:
    """One launch: ``trainer`` stepped to ``end`` in ``run_dir``, from scratch or (``resume``) from its newest valid
    checkpoint; ``snapshots``: steps at which to copy the state (the continuous run's, for the other legs)."""

    trainer: str
    run_dir: str
    end: int
    every: int
    seed: int = 0
    resume: bool = False
    fault: Fault | None = None
    snapshots: tuple[int, ...] = ()
    commit_bug: str | None = None
    """One of :data:`harness.resume.commit_controls.COMMIT_BUGS`, installed in the ranks (negative controls only)."""


def _state(trainer: Trainer) -> dict[str, Any]:
    """A CPU copy of the trainer's state, once the contract admits every value in it."""
    return dict(cpu_copy(dict(check_state(trainer.state()))))


def _position(trainer: Trainer) -> int:
    step = check_state(trainer.state()).get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        msg = (f"the trainer's state() has step={step!r}: the contract wants 'step', the optimizer steps taken (an "
               "int), which its checkpoints are labelled with")
        raise ResumeMismatch(msg)
    return step


@contextmanager
def _kill_inside_step(fault: Fault | None, rank: int, step: int, run_dir: str) -> Iterator[None]:
    if fault is None or fault.point != "in-step" or (fault.rank, fault.step) != (rank, step):
        yield
        return
    calls = [0]

    def hook(_module: Any, _inputs: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:  # the first forward ran: the rank is inside its step's computation
            die_at(fault, rank, step, "in-step", run_dir)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
    die_at(fault, rank, step, "in-step", run_dir)  # a step without two module forwards: killed at its end


def _checkpoint(trainer: Trainer, leg: Leg, step: int, rank: int, world: int) -> str:
    folder = begin_step_dir(leg.run_dir, step, rank=rank)
    trainer.save(folder)
    die_at(leg.fault, rank, step, "in-save", leg.run_dir)
    positions: list[Any] = [None] * world
    dist.all_gather_object(positions, _position(trainer))  # also the barrier: every rank's save has returned
    if rank == 0:
        commit_step_dir(folder, step, world_size=world, positions=positions, layout=LAYOUT_TRAINER,
                        midway=lambda: die_at(leg.fault, rank, step, "before-commit", leg.run_dir))
    dist.barrier()
    die_at(leg.fault, rank, step, "after-commit", leg.run_dir)
    return folder.name


def run_leg(leg: Leg) -> dict[str, Any]:
    """Rank body for :func:`harness.distributed.launcher.launch`: one leg; returns this rank's summary. A trainer that
    cannot run deterministically returns ``{"not_bitwise": reason}`` instead."""
    rank, world = dist.get_rank(), dist.get_world_size()
    apply_deterministic()
    if leg.commit_bug is not None:
        from harness.resume.commit_controls import install

        install(leg.commit_bug)
    seed_globals(leg.seed, rank)
    _own_start_method()
    _tie_children_to_this_rank()
    try:
        return _run(leg, rank, world)
    except RuntimeError as exc:
        if "deterministic" not in str(exc):
            raise
        return {"not_bitwise": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    finally:
        _stop_children()


def _own_start_method() -> None:
    """Give this rank the start method a process started by ``python`` or torchrun has: the platform's default.

    A rank forked by the launcher's forkserver inherits that server's start method and address, so a DataLoader's
    workers (started through the default context) would go to the launcher's server instead of being this rank's
    children, and hang there. Resetting the default, and forgetting the inherited server, makes a forkserver
    context (the default from Python 3.14 on) start one of the rank's own."""
    from multiprocessing import forkserver

    multiprocessing.set_start_method(None, force=True)
    server: Any = forkserver._forkserver
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


def _tie_children_to_this_rank() -> None:
    """Every process forked from this rank from now on gets SIGKILL when the rank dies (a killed rank runs no
    clean-up of its own, and a DataLoader's workers would otherwise wait for a next batch that never comes).

    ``prctl`` is looked up here, before any fork: the child of a process with other threads (gloo's) must not
    ``dlopen`` anything, since a lock another thread held at the fork stays held in the child forever."""
    if not sys.platform.startswith("linux"):
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    os.register_at_fork(after_in_child=lambda: prctl(1, signal.SIGKILL))  # 1: PR_SET_PDEATHSIG


def _stop_children() -> None:
    """Stop what the loop started and left running (a DataLoader's workers of an iterator still alive): the rank
    leaves through ``os._exit``, which would leave them to find out on their own."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(5)
        if child.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]


def _run(leg: Leg, rank: int, world: int) -> dict[str, Any]:
    trainer = load_trainer(leg.trainer)
    check_state(trainer.state())  # a value the comparison cannot judge is refused before the first step
    start, resumed_from = 0, None
    skipped: list[str] = []
    if leg.resume:
        # Through the module, so that a commit control (trust_newest) replaces the one discovery everywhere.
        found = checkpoint.newest_valid_checkpoint(leg.run_dir, allow_older=False)
        if found.folder is None:
            msg = f"{leg.run_dir}: no complete checkpoint to resume from (skipped: {list(found.skipped)})"
            raise ResumeMismatch(msg)
        manifest = check_step_dir(found.folder)
        trainer.load(found.folder)
        start, resumed_from = int(manifest["step"]), found.folder.name
        skipped = [f"{folder.name} ({kind})" for folder, kind, _ in found.skipped]
        got = _position(trainer)
        if got != start:
            msg = (f"labels: after load({found.folder}) the trainer's state()['step'] is {got}, the checkpoint is of "
                   f"step {start}: a resumed run that counts from {got} labels its checkpoints wrongly")
            raise ResumeMismatch(msg)
    losses: dict[int, float] = {}
    written: list[str] = []
    snapshots: dict[int, Any] = {}
    for step in range(start + 1, leg.end + 1):
        with _kill_inside_step(leg.fault, rank, step, leg.run_dir):
            loss = trainer.step()
        draw_globals()  # so that a global generator a resume does not restore shows (generators.py says why)
        losses[step] = float(loss)
        if step % leg.every == 0 or step == leg.end:
            written.append(_checkpoint(trainer, leg, step, rank, world))
        if step in leg.snapshots:
            snapshots[step] = {"state": _state(trainer), "rng": global_states()}
    out = {"rank": rank, "start": start, "resumed_from": resumed_from, "skipped": skipped, "losses": losses,
           "checkpoints": written, "state": _state(trainer), "rng": global_states(), "snapshots": snapshots}
    close = getattr(trainer, "close", None)
    if callable(close):
        close()
    del trainer
    return out


__all__ = ["KILL_POINTS", "Leg", "ResumeMismatch", "run_leg"]
