"""Command line of seed 000's workflow, one process per rank under torchrun:

    torchrun --nnodes=1 --nproc-per-node=2 -m harness.train --config configs/minimum.yaml               # stop at 50
    torchrun --nnodes=1 --nproc-per-node=2 -m harness.train --config configs/minimum.yaml --continuous  # to 100
    torchrun --nnodes=1 --nproc-per-node=2 -m harness.train --config configs/minimum.yaml \\
        --resume runs/stopped/step-0050                                                               # 50 -> 100

The three runs write to ``runs/stopped``, ``runs/continuous`` and ``runs/resumed`` unless ``--run-dir`` says otherwise,
so a resumed run never overwrites the checkpoints it came from. ``--resume`` takes a step directory, or a run
directory: then its newest complete checkpoint is used and named. Step directories without a manifest (a checkpoint a
kill interrupted) are skipped; if the newest one with a manifest is corrupt, the command refuses and names it, unless
``--allow-older`` lets it fall back to the newest valid one (it says what it skipped).

Run as a module (the torchrun worker), it leaves through :func:`entry`: the process group is destroyed, stdout and
stderr are flushed, and the process ends with ``os._exit``, skipping the interpreter's teardown, in which gloo's and
DDP's threads could abort the worker ("terminate called without an active exception", SIGABRT) after its work was
done. :func:`main` itself returns (or raises) like any function, so tests can call it in-process.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from harness.data.config import load_config
from harness.data.corpus import data_lock, make_corpus
from harness.distributed.worker import default_backend, exit_worker
from harness.resume.checkpoint import (
    MANIFEST,
    CorruptCheckpoint,
    load_checkpoint,
    newest_valid_checkpoint,
    step_dirs,
    step_of,
)

BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl")
DEFAULT_RUN_DIRS = {"stopped": "runs/stopped", "continuous": "runs/continuous", "resumed": "runs/resumed"}
PG_TIMEOUT_S = 300


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/minimum.yaml")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--continuous", action="store_true", help="run to config.updates instead of stopping at stop_at")
    mode.add_argument("--resume", metavar="DIR", help="continue to config.updates from a step (or run) directory")
    p.add_argument(
        "--allow-older", action="store_true",
        help="with --resume RUN_DIR: if its newest checkpoint is corrupt, resume from the newest valid one instead",
    )
    p.add_argument("--run-dir", metavar="DIR", help="where checkpoints and eval.json go (default: runs/<mode>)")
    p.add_argument("--backend", choices=BACKENDS, help="default: nccl when every rank has its own GPU, else gloo")
    args = p.parse_args(argv)
    if args.allow_older and not args.resume:
        p.error("--allow-older only applies to --resume RUN_DIR")
    return args


def resolve_resume(path: str, *, allow_older: bool = False, say: Callable[[str], None] = print) -> Path:
    """The step directory ``--resume PATH`` means; ``say`` is told which one and what was skipped.

    A step directory is returned as it is (:func:`load_checkpoint` then says precisely what is wrong with it, if
    anything). A run directory gives its newest complete checkpoint. Step directories without a manifest are
    checkpoints a kill interrupted: skipped, and said. The newest one with a manifest must be valid: if it is corrupt
    (malformed manifest, missing or changed file) this refuses, naming it, unless ``allow_older``, which skips it
    (and any other corrupt one) for the newest valid checkpoint below it. SystemExit carries every refusal.
    """
    folder = Path(path)
    if (folder / MANIFEST).is_file() or step_of(folder.name) is not None:
        return folder
    if not step_dirs(folder):
        msg = f"--resume {path!r} is neither a step directory nor a run directory holding a complete checkpoint"
        raise SystemExit(msg)
    try:
        found = newest_valid_checkpoint(folder, allow_older=allow_older)
    except CorruptCheckpoint as exc:
        msg = (
            f"--resume {path!r}: its newest checkpoint {exc.folder} is corrupt: {exc.reason}\n"
            f"refusing to resume from an older one silently; pass --allow-older to use the newest valid "
            f"checkpoint below it, or --resume an older step directory"
        )
        raise SystemExit(msg) from None
    skipped = [f"{d} ({kind}: {reason})" for d, kind, reason in found.skipped]
    if found.folder is None:
        msg = f"--resume {path!r}: no complete checkpoint in that run directory; skipped: " + "; ".join(skipped)
        raise SystemExit(msg)
    for line in skipped:
        say(f"--resume: skipped {line}")
    say(f"--resume: using {found.folder}, the newest complete checkpoint of {path}")
    return found.folder


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config)
    except ValueError as exc:
        raise SystemExit(f"--config: {exc}") from None
    if "RANK" not in os.environ:
        msg = (
            "harness.train runs one process per rank: start it with "
            f"torchrun --nnodes=1 --nproc-per-node={config.world_size} -m harness.train --config {args.config}"
        )
        raise SystemExit(msg)
    world = int(os.environ["WORLD_SIZE"])
    if world != config.world_size:
        msg = (
            f"torchrun started {world} ranks but world_size={config.world_size} in {args.config}; "
            f"use --nproc-per-node={config.world_size}"
        )
        raise SystemExit(msg)
    mode = "resumed" if args.resume else "continuous" if args.continuous else "stopped"
    run_dir = Path(args.run_dir or DEFAULT_RUN_DIRS[mode])
    say = print if os.environ["RANK"] == "0" else _silent
    resume = resolve_resume(args.resume, allow_older=args.allow_older, say=say) if args.resume else None
    if resume is not None:
        # Refuse a wrong checkpoint before any rank joins a process group: a clean message, not W tracebacks.
        rows = make_corpus(config)
        try:
            load_checkpoint(resume, config=config, data_lock=data_lock(rows, config), rank=int(os.environ["RANK"]),
                            world_size=world)
        except ValueError as exc:
            raise SystemExit(f"--resume: {exc}") from None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = args.backend or default_backend(local_world)
    if "nccl" in backend and torch.cuda.device_count() < local_world:
        msg = (
            f"--backend {backend} needs one CUDA device per local rank ({local_world}), found "
            f"{torch.cuda.device_count()}; use --backend gloo"
        )
        raise SystemExit(msg)
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        from harness.training.trainer import run

        if dist.get_rank() == 0:
            print(f"{mode} run: {world} ranks, backend {backend}, run dir {run_dir}", flush=True)
        summary = run(config, run_dir, stop_at=config.stop_at if mode == "stopped" else None, resume=resume,
                      evaluate=True)
        if dist.get_rank() == 0:
            print(f"done at step {summary['final_step']}; checkpoints in {run_dir}", flush=True)
        del summary  # holds tensors copied off the model; nothing of DDP may outlive the process group
    finally:
        gc.collect()  # frees a DDP module held only by a reference cycle while its process group still exists
        dist.destroy_process_group()
    return 0


def _silent(_message: str) -> None:
    pass


def entry(argv: Sequence[str] | None = None) -> NoReturn:
    """The torchrun worker: :func:`main`, then ``os._exit`` with its status
    (:func:`harness.distributed.worker.exit_worker`). Never call this in-process: it ends the calling process."""
    exit_worker(main, argv)


if __name__ == "__main__":
    entry()
