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
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.data.config import Config

MANIFEST = "manifest.json"
SHARED = "shared.pt"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{4,})$")

# Config fields that do not change the trajectory of the first ``updates`` steps: where a run stops and how often it
# checkpoints. Every other field (the schedule's ``updates`` included) changes the numbers, so a resume refuses it.
NON_TRAJECTORY_FIELDS = frozenset({"stop_at", "checkpoint_every"})


def step_dir_name(step: int) -> str:
    return f"step-{step:04d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


# --------------------------------------------------------------------------------------------------------- writing


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(path: Path, data: bytes) -> Path:
    """Write ``data`` durably under a temporary name next to ``path``; return that name (not yet renamed)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _commit(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a reader sees either the old file or the whole new one."""
    _commit(_write_temp(path, data), path)


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
    folder = Path(run_dir) / step_dir_name(step)
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        # A folder left by an earlier, killed attempt at this step must not keep an old manifest that would vouch
        # for files about to be replaced.
        (folder / MANIFEST).unlink(missing_ok=True)
    _barrier()  # the folder exists and holds no stale manifest before anyone writes into it
    if rank == 0:
        if shared is None:
            msg = "save_checkpoint: rank 0 must pass shared= (model, optimizer, scheduler, config, data lock, step)"
            raise ValueError(msg)
        write_atomic(folder / SHARED, _to_bytes(dict(shared)))
    own = folder / rank_file(rank)
    tmp = _write_temp(own, _to_bytes(dict(rank_state)))
    if point:
        point("after-rank-temp")
    _commit(tmp, own)
    _barrier()  # every rank's file is in: only now may the checkpoint be declared complete
    if rank == 0:
        if point:
            point("before-manifest")
        names = [SHARED, *(rank_file(r) for r in range(world_size))]
        files = {n: {"size": (folder / n).stat().st_size, "sha256": _sha256(folder / n)} for n in names}
        manifest = {"format": FORMAT, "step": step, "world_size": world_size, "files": files}
        write_atomic(folder / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    _barrier()  # no rank returns (and perhaps exits) before the checkpoint it took part in is complete
    if point:
        point("after-manifest")
    return folder


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------- reading


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of ``folder``, after checking that every file it lists is there, whole, and unchanged."""
    folder = Path(folder)
    if not folder.is_dir():
        msg = f"checkpoint {str(folder)!r} is not a directory; pass a step directory such as runs/stopped/step-0050"
        raise ValueError(msg)
    path = folder / MANIFEST
    if not path.is_file():
        msg = (
            f"checkpoint {str(folder)!r} has no {MANIFEST}: it is incomplete (the run was stopped while writing it); "
            "resume from an earlier step directory or use latest_checkpoint(run_dir)"
        )
        raise ValueError(msg)
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        int(manifest["world_size"])
        int(manifest["step"])
    except (ValueError, KeyError, TypeError) as exc:
        msg = f"{path}: not a valid manifest ({exc!r}); the checkpoint cannot be trusted, resume from another step"
        raise ValueError(msg) from None
    for name, entry in files.items():
        _check_file(folder / name, entry)
    for r in range(int(manifest["world_size"])):
        if rank_file(r) not in files:
            msg = f"{path}: lists no {rank_file(r)} for world size {manifest['world_size']}; the manifest is damaged"
            raise ValueError(msg)
    return dict(manifest)


def _check_file(path: Path, entry: Mapping[str, Any]) -> None:
    if not path.is_file():
        kind = "rank file" if path.name.startswith("rank-") else "file"
        msg = f"{path}: missing {kind} listed in {MANIFEST}; the checkpoint is incomplete, resume from another step"
        raise ValueError(msg)
    size = path.stat().st_size
    if size != entry["size"]:
        what = "truncated" if size < entry["size"] else "longer than recorded"
        msg = f"{path}: {what}: {size} bytes, {MANIFEST} says {entry['size']}; resume from another step"
        raise ValueError(msg)
    digest = _sha256(path)
    if digest != entry["sha256"]:
        msg = (
            f"{path}: checksum mismatch: SHA-256 {digest[:16]}..., {MANIFEST} says {entry['sha256'][:16]}...; "
            "the file was changed or corrupted, resume from another step"
        )
        raise ValueError(msg)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The highest ``step-NNNN`` folder of ``run_dir`` whose manifest is valid; incomplete folders are skipped."""
    root = Path(run_dir)
    if not root.is_dir():
        return None
    steps = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))),
        reverse=True,
    )
    for _, folder in steps:
        try:
            read_manifest(folder)
        except ValueError:
            continue
        return folder
    return None


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
    manifest = read_manifest(folder)
    if manifest["world_size"] != world_size:
        msg = (
            f"{folder / MANIFEST}: written by world size {manifest['world_size']}, this run has {world_size}; "
            "resume with the same number of ranks (per-rank RNG states and plan shards depend on it)"
        )
        raise ValueError(msg)
    shared = _load(folder / SHARED)
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
    state = _load(folder / rank_file(rank))
    if state["rank"] != rank or state["world_size"] != world_size:
        msg = (
            f"{folder / rank_file(rank)}: holds rank {state['rank']} of {state['world_size']}, expected rank {rank} "
            f"of {world_size}; the file was renamed or copied from another checkpoint"
        )
        raise ValueError(msg)
    return shared, state


def _load(path: Path) -> dict[str, Any]:
    try:
        # weights_only: a checkpoint is data, never code to run; everything saved here is tensors and plain Python.
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        msg = f"{path}: cannot be read as a checkpoint file ({type(exc).__name__}: {exc}); resume from another step"
        raise ValueError(msg) from None
    if not isinstance(obj, dict):
        msg = f"{path}: holds a {type(obj).__name__}, not a checkpoint mapping"
        raise ValueError(msg)
    return obj


__all__ = [
    "MANIFEST",
    "NON_TRAJECTORY_FIELDS",
    "SHARED",
    "latest_checkpoint",
    "load_checkpoint",
    "rank_file",
    "read_manifest",
    "save_checkpoint",
    "step_dir_name",
    "trajectory_mismatch",
    "write_atomic",
]
