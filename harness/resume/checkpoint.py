"""Checkpoints that let a run continue its trajectory, and survive a kill while they are being written.

Layout of one checkpoint, ``run_dir/step-NNNN/``:

* ``shared.pt`` (rank 0): model weights, optimizer (momentum buffers), scheduler, config, data lock, step.
* ``rank-R.pt`` (every rank): rank, world size, this rank's Python / numpy / torch CPU / CUDA RNG states, the plan
  position (the next step index) and the loss history. RNG states are per rank because dropout masks are: restoring
  rank 0's states on every rank would silently give every rank the same masks.
* ``manifest.json`` (rank 0, written last): size and SHA-256 of every file above.

Why it is written this way: a job can be killed at any instant, also halfway through a checkpoint. Each file goes to a
temporary name in the same folder, is flushed and fsynced, then renamed over its final name (``os.replace`` is atomic
within a file system), and the folder is fsynced so the rename itself survives a crash. The manifest is written only
after a barrier that every rank enters once its own file is in; a folder without a valid manifest is therefore an
incomplete checkpoint, and :func:`latest_checkpoint` skips it. Every rank calls :func:`save_checkpoint` and takes part
in the same collectives: rank 0 writing more files than its peers never means a peer skips a barrier.

The file-level pieces live beside this module: :mod:`~harness.resume.atomic` (temporary, fsync, rename) and
:mod:`~harness.resume.manifest` (the manifest and its checks). This module keeps the step directories: their names,
writing one collectively, finding the latest, auditing a run directory, and loading one into a run.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.data.config import Config
from harness.distributed.scratch import pid_alive
from harness.resume.atomic import TEMP_NAME, commit, fsync_dir, write_atomic, write_temp
from harness.resume.manifest import (
    FORMAT,
    LAYOUT_HARNESS,
    LAYOUT_TRAINER,
    MANIFEST,
    SHARED,
    rank_file,
    read_manifest,
    sha256,
)

_STEP_DIR = re.compile(r"^step-(\d{4,})$")

# Config fields that do not change the trajectory of the first ``updates`` steps: where a run stops and how often it
# checkpoints. Every other field (the schedule's ``updates`` included) changes the numbers, so a resume refuses it.
NON_TRAJECTORY_FIELDS = frozenset({"stop_at", "checkpoint_every"})


def step_dir_name(step: int) -> str:
    """``7`` -> ``step-0007``: the one place a step directory's name is made; :func:`step_of` reads it back."""
    return f"step-{step:04d}"


def step_of(name: str) -> int | None:
    """``step-0007`` -> 7; None for any name :func:`step_dir_name` does not make."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def step_dirs(run_dir: str | Path) -> list[Path]:
    """The step directories of ``run_dir``, newest (highest step) first, complete or not; [] if it is no folder."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if p.is_dir() and (step := step_of(p.name)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def begin_step_dir(run_dir: str | Path, step: int, *, rank: int) -> Path:
    """Every rank: make ``run_dir/step-NNNN`` durable and empty; return it (collective).

    A folder of that name left by an earlier attempt at this step (a kill inside its save, or before its commit)
    still holds that attempt's files: a save that will not overwrite (``torch.distributed.checkpoint`` with
    ``overwrite=False``, a ``mkdir()`` without ``exist_ok``) would fail on them, and a file the new save does not
    write again would reach the new manifest. So rank 0 first renames the old folder out of the way (atomic: a crash
    leaves either the old folder or none under the step's name, never half of it), fsyncs the run directory, and
    deletes it; then makes the new folder. The run directory is fsynced after the step directory is made: without it
    a crash could lose the new entry itself, and the files later written (and fsynced) inside it would vanish with it.
    """
    folder = Path(run_dir) / step_dir_name(step)
    if rank == 0:
        folder.parent.mkdir(parents=True, exist_ok=True)
        if folder.exists():
            stale = folder.with_name(f".{folder.name}.stale-{os.getpid()}")
            os.replace(folder, stale)  # the stale name matches no step directory: discovery never reads it
            fsync_dir(folder.parent)
            shutil.rmtree(stale, ignore_errors=True)
        folder.mkdir()
        fsync_dir(folder.parent)
        fsync_dir(folder)
    _barrier()  # the folder exists and is empty before anyone writes into it
    folder.mkdir(parents=True, exist_ok=True)  # outside a process group (one process) there was no barrier to wait
    return folder


def checkpoint_files(folder: Path) -> list[str]:
    """Every file under ``folder`` a manifest vouches for, as relative POSIX paths, sorted; hidden temporaries
    (:data:`~harness.resume.atomic.TEMP_NAME`) and the manifest itself are left out."""
    names = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != MANIFEST and not TEMP_NAME.match(path.name):
            names.append(rel)
    return names


def commit_step_dir(
    folder: Path, step: int, *, world_size: int, positions: list[int] | None, layout: str = LAYOUT_HARNESS,
    names: list[str] | None = None, midway: Callable[[], None] | None = None,
) -> None:
    """Rank 0, once every rank's files are in: write the manifest (sizes, SHA-256, step, each rank's data position)
    atomically, last. From this instant the step directory is a complete checkpoint. ``midway()`` is called with
    half of the manifest written (:func:`~harness.resume.atomic.write_temp`)."""
    listed = checkpoint_files(folder) if names is None else names
    files = {n: {"size": (folder / n).stat().st_size, "sha256": sha256(folder / n)} for n in listed}
    manifest: dict[str, Any] = {"format": FORMAT, "layout": layout, "step": step, "world_size": world_size,
                                "files": files}
    if positions is not None:
        manifest["positions"] = list(positions)
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode(), midway)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    shared: Mapping[str, Any] | None,
    rank_state: Mapping[str, Any],
    rank: int,
    world_size: int,
    point: Callable[[str], None] | None = None,
) -> Path:
    """Write ``run_dir/step-NNNN`` collectively: every rank calls this, with ``shared`` given on rank 0 only.

    ``point(name)`` is called at the named fault-injection points (``after-rank-temp``, ``before-manifest``,
    ``after-manifest``) so a test can kill a rank exactly there.
    """
    if rank == 0 and shared is None:
        msg = "save_checkpoint: rank 0 must pass shared= (model, optimizer, scheduler, config, data lock, step)"
        raise ValueError(msg)
    folder = begin_step_dir(run_dir, step, rank=rank)
    write_checkpoint_files(folder, shared=shared, rank_state=rank_state, rank=rank, point=point)
    _barrier()  # every rank's file is in: only now may the checkpoint be declared complete
    if rank == 0:
        if point:
            point("before-manifest")
        names = [SHARED, *(rank_file(r) for r in range(world_size))]
        commit_step_dir(folder, step, world_size=world_size, positions=_positions(folder, world_size), names=names)
    _barrier()  # no rank returns (and perhaps exits) before the checkpoint it took part in is complete
    if point:
        point("after-manifest")
    return folder


def write_checkpoint_files(
    folder: Path, *, shared: Mapping[str, Any] | None, rank_state: Mapping[str, Any], rank: int,
    point: Callable[[str], None] | None = None,
) -> None:
    """This rank's files of the harness's format into ``folder``: ``shared.pt`` (rank 0) and ``rank-R.pt``, each
    written under a temporary name, fsynced and renamed. No barrier and no manifest: the caller commits."""
    if rank == 0 and shared is not None:
        write_atomic(folder / SHARED, _to_bytes(dict(shared)))
    own = folder / rank_file(rank)
    tmp = write_temp(own, _to_bytes(dict(rank_state)))
    if point:
        point("after-rank-temp")
    commit(tmp, own)


def _positions(folder: Path, world_size: int) -> list[int] | None:
    """Each rank's data position as its rank file records it (None when a file records none: a bare test file)."""
    out = []
    for r in range(world_size):
        state = torch.load(folder / rank_file(r), map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not isinstance(state.get("position"), int):
            return None
        out.append(int(state["position"]))
    return out


class CorruptCheckpoint(ValueError):
    """The newest step directory with a manifest cannot be trusted, and the caller did not allow an older one."""

    def __init__(self, folder: Path, reason: str) -> None:
        super().__init__(f"{folder}: {reason}")
        self.folder, self.reason = folder, reason


@dataclass(frozen=True)
class Discovery:
    """What :func:`newest_valid_checkpoint` found: the folder (None: no valid one) and what it skipped on the way,
    newest first, as ``(folder, "incomplete" | "corrupt", reason)``."""

    folder: Path | None
    skipped: tuple[tuple[Path, str, str], ...] = ()


def check_step_dir(folder: str | Path) -> dict[str, Any]:
    """The manifest of ``folder`` once the step directory is a valid checkpoint: every file whole
    (:func:`read_manifest`), and its labels agree: the directory's name, the manifest's ``step`` and every rank's
    recorded data position name the same step. ValueError naming the folder and the values that disagree."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    named = step_of(folder.name)
    positions = manifest.get("positions")
    if (named is not None and named != manifest["step"]) or (positions is not None and any(
            p != manifest["step"] for p in positions)):
        msg = (f"{folder}: labels disagree: the directory names step {named}, {MANIFEST} says step "
               f"{manifest['step']}, the ranks' data positions are {positions}; a checkpoint must be named after the "
               "step whose state it holds (a resumed run that counts its steps from 0, or a data position saved off "
               "by one, writes such a folder)")
        raise ValueError(msg)
    return manifest


def newest_valid_checkpoint(run_dir: str | Path, *, allow_older: bool = True) -> Discovery:
    """The one discovery of where a run resumes: the highest ``step-NNNN`` of ``run_dir`` that
    :func:`check_step_dir` accepts. Every entry uses it: :func:`latest_checkpoint`, ``--resume RUN_DIR``
    (:func:`harness.training.torchrun.resolve_resume`), ``resume="latest:..."`` of the launcher's rank body, and the
    resume battery.

    A step directory without a manifest is a checkpoint a kill interrupted: always skipped. One with a manifest that
    fails the check is corrupt: skipped when ``allow_older``, else :class:`CorruptCheckpoint` (an older checkpoint is
    never used silently in place of a damaged newer one).
    """
    skipped: list[tuple[Path, str, str]] = []
    for folder in step_dirs(run_dir):
        if not (folder / MANIFEST).is_file():
            skipped.append((folder, "incomplete", f"no {MANIFEST}"))
            continue
        try:
            check_step_dir(folder)
        except ValueError as exc:
            if not allow_older:
                raise CorruptCheckpoint(folder, str(exc)) from None
            skipped.append((folder, "corrupt", str(exc)))
            continue
        return Discovery(folder, tuple(skipped))
    return Discovery(None, tuple(skipped))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The highest ``step-NNNN`` folder of ``run_dir`` that is a valid checkpoint (:func:`newest_valid_checkpoint`);
    incomplete and corrupt folders are skipped."""
    return newest_valid_checkpoint(run_dir).folder


def audit_run_dir(run_dir: str | Path) -> list[str]:
    """Every problem in ``run_dir``, one line each, naming its path; [] when the run directory is sound.

    Reported: a step directory whose manifest is missing (a checkpoint a kill interrupted) or malformed, or whose
    files are missing, truncated or fail their checksum; and a temporary file (``.NAME.tmp-PID``, see
    :func:`write_atomic`) anywhere under ``run_dir`` whose writing process is no longer running: what a killed run
    leaves behind. A temporary of a process still running on this machine is being written now, and is not reported;
    one of a process that has ended but was not reaped yet (a zombie) is
    (:func:`harness.distributed.scratch.pid_alive`). A missing ``run_dir`` is one problem.
    """
    root = Path(run_dir)
    if not root.is_dir():
        return [f"{root}: not a directory"]
    problems = []
    for folder in sorted(step_dirs(root)):
        try:
            check_step_dir(folder)
        except ValueError as exc:
            kind = "incomplete" if not (folder / MANIFEST).is_file() else "corrupt"
            problems.append(f"{folder}: {kind} checkpoint: {exc}")
    for path in sorted(root.rglob(".*.tmp-*")):
        m = TEMP_NAME.match(path.name)
        if m is None or not path.is_file() or pid_alive(int(m.group("pid"))):
            continue
        problems.append(
            f"{path}: stale temporary file of {m.group('name')}, left by process {m.group('pid')} (no longer "
            "running) when it was killed mid-write; delete it"
        )
    return problems


def trajectory_mismatch(saved: Mapping[str, Any], config: Config) -> tuple[str, Any, Any] | None:
    """The first config field that differs and would change the trajectory: ``(key, saved, now)``, or None."""
    now = config.to_dict()
    for key in sorted(set(saved) | set(now)):
        if key in NON_TRAJECTORY_FIELDS:
            continue
        if saved.get(key) != now.get(key):
            return key, saved.get(key), now.get(key)
    return None


def load_checkpoint(
    folder: str | Path, *, config: Config, data_lock: str, rank: int, world_size: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validate ``folder`` against this run; return ``(shared, this rank's state)``. ValueError names what differs."""
    folder = Path(folder)
    manifest = check_step_dir(folder)
    if manifest["world_size"] != world_size:
        msg = (
            f"{folder / MANIFEST}: written by world size {manifest['world_size']}, this run has {world_size}; "
            "resume with the same number of ranks (per-rank RNG states and plan shards depend on it)"
        )
        raise ValueError(msg)
    shared = _load(folder / SHARED, ("data_lock", "config", "model", "optimizer", "scheduler"))
    if shared["data_lock"] != data_lock:
        msg = (
            f"{folder / SHARED}: other data lock {shared['data_lock'][:16]}..., this run's data gives "
            f"{data_lock[:16]}...; resume with the config and corpus the checkpoint was made from"
        )
        raise ValueError(msg)
    diff = trajectory_mismatch(shared["config"], config)
    if diff is not None:
        key, was, now = diff
        msg = (
            f"{folder / SHARED}: config key {key!r} differs: checkpoint has {was!r}, this run has {now!r}; it changes "
            "the trajectory, so resume with the checkpoint's value (only stop_at and checkpoint_every may change)"
        )
        raise ValueError(msg)
    state = _load(folder / rank_file(rank), ("rank", "world_size", "position", "losses", "rng"))
    if state["rank"] != rank or state["world_size"] != world_size:
        msg = (
            f"{folder / rank_file(rank)}: holds rank {state['rank']} of {state['world_size']}, expected rank {rank} "
            f"of {world_size}; the file was renamed or copied from another checkpoint"
        )
        raise ValueError(msg)
    if state["position"] != manifest["step"]:
        msg = (f"{folder / rank_file(rank)}: data position {state['position']!r}, but {MANIFEST} says step "
               f"{manifest['step']}; the labels of this checkpoint disagree, resume from another step")
        raise ValueError(msg)
    return shared, state


def _load(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    try:
        # weights_only: a checkpoint is data, never code to run; everything saved here is tensors and plain Python.
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        msg = f"{path}: cannot be read as a checkpoint file ({type(exc).__name__}: {exc}); resume from another step"
        raise ValueError(msg) from None
    if not isinstance(obj, dict):
        msg = f"{path}: holds a {type(obj).__name__}, not a checkpoint mapping"
        raise ValueError(msg)
    missing = [k for k in keys if k not in obj]
    if missing:
        msg = f"{path}: lacks {', '.join(missing)}; it was not written by this trainer, resume from another step"
        raise ValueError(msg)
    return obj


# MANIFEST, SHARED, rank_file, read_manifest (manifest.py) and write_atomic (atomic.py) stay importable from here,
# where the workflow and the tests import them.
__all__ = [
    "FORMAT",
    "LAYOUT_HARNESS",
    "LAYOUT_TRAINER",
    "MANIFEST",
    "NON_TRAJECTORY_FIELDS",
    "SHARED",
    "CorruptCheckpoint",
    "Discovery",
    "audit_run_dir",
    "begin_step_dir",
    "check_step_dir",
    "checkpoint_files",
    "commit_step_dir",
    "latest_checkpoint",
    "load_checkpoint",
    "newest_valid_checkpoint",
    "rank_file",
    "read_manifest",
    "save_checkpoint",
    "step_dir_name",
    "step_dirs",
    "step_of",
    "trajectory_mismatch",
    "write_atomic",
    "write_checkpoint_files",
]
