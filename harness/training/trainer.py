"""The training loop of seed 000's r1 workflow, with checkpoints whose resume lands on the same bits.

Called on every rank inside an initialized process group (the test launcher, or torchrun through
``python -m harness.train``). Every piece of state a resume must restore is made to matter, so that a checkpoint that
forgets one is caught by the bitwise comparison at the last step:

* SGD **with momentum**: the optimizer holds a buffer per parameter.
* A learning-rate schedule (linear warm-up, then linear decay to 0 at ``config.updates``) defined over the whole run:
  a stop at 50 does not shorten it, so the scheduler's position is state.
* Dropout > 0 drawn from each rank's own torch RNG stream, seeded from ``(seed, rank)``: ranks draw different masks,
  so restoring rank 0's RNG state on every rank changes rank 1's masks.
* The plan (ids per step, rank, microbatch) is drawn once from its own seed; the position in it is state.

``resume_bug`` reproduces real resume mistakes as negative controls for the tests; never set it in a real run.

The pieces the loop uses live by job beside it: :mod:`~harness.training.schedule` (the learning-rate factor),
:mod:`~harness.training.rng` (per-rank generators), :mod:`~harness.training.faults` (``HARNESS_FAULT`` kill points),
:mod:`~harness.training.state` (CPU copies and :func:`state_difference`), :mod:`~harness.training.checkpoint` and
:mod:`~harness.training.evaluation`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from harness.core.microbatch import Microbatch
from harness.data.batching import collate
from harness.data.config import Config
from harness.data.corpus import data_lock, make_corpus
from harness.data.plan import make_plan
from harness.distributed.strategies.ddp import DDPStrategy
from harness.model import build_model
from harness.recipes import Recipe, load_recipe
from harness.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from harness.training.evaluation import evaluate_model, write_eval
from harness.training.faults import FAULT_ENV, FAULT_POINTS, FAULT_RECORD, Fault, die_at, parse_fault
from harness.training.rng import rank_seed, rng_state, seed_rngs, set_rng_state
from harness.training.schedule import WarmupLinearDecay
from harness.training.state import cpu_copy, state_difference

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel as DDP

RESUME_BUGS = ("reseed", "drop_optimizer", "rank0_rng", "restart_plan")
"""Negative controls: re-seed the RNGs instead of restoring them; do not load the optimizer state; restore rank 0's
RNG states on every rank; restart the plan from its first step."""

# ----------------------------------------------------------------------------------------------------- the loop


def _device(device: str | None = None) -> torch.device:
    """``device=None`` picks from the backend: NCCL reduces CUDA tensors only, so it means this rank's GPU; under
    gloo the trainer stays on the CPU (where its ops are deterministic) unless asked for ``"cuda"``: then the current
    CUDA device, which the launcher (``launch(..., device="cuda")``) or torchrun's LOCAL_RANK chose."""
    if device not in (None, "cpu", "cuda"):
        msg = f"device={device!r} must be None (from the backend), 'cpu' or 'cuda'"
        raise ValueError(msg)
    if device == "cuda" or (device is None and "nccl" in str(dist.get_backend())):
        if "nccl" in str(dist.get_backend()) and device is None:
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    if device == "cpu" and str(dist.get_backend()) == "nccl":
        msg = "device='cpu' cannot train under a pure NCCL process group; use backend gloo or 'cpu:gloo,cuda:nccl'"
        raise ValueError(msg)
    return torch.device("cpu")


def _is_checkpoint_step(step: int, config: Config, end: int) -> bool:
    return step % config.checkpoint_every == 0 or step in (config.stop_at, end)


def run(
    config: Config,
    run_dir: str | Path,
    *,
    stop_at: int | None = None,
    resume: str | Path | None = None,
    recipe: Recipe | str | None = None,
    resume_bug: str | None = None,
    evaluate: bool = False,
    log: Callable[[str], None] | None = None,
    device_choice: str | None = None,
) -> dict[str, Any]:
    """Train from scratch (or from ``resume``, a step directory) up to ``stop_at`` (default ``config.updates``).

    Checkpoints every ``config.checkpoint_every`` steps, at ``config.stop_at`` and at the last step. Returns a plain
    summary: final step, loss history, checkpoints written, the final model / optimizer / scheduler state (small CPU
    tensors) and a draw from each RNG, so a test can compare a resumed run with a continuous one bit for bit.
    """
    if not dist.is_initialized():
        msg = "trainer.run must be called on every rank inside an initialized process group (launcher or torchrun)"
        raise RuntimeError(msg)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != config.world_size:
        msg = f"world_size={world} (ranks started) differs from config world_size={config.world_size}; start that many"
        raise ValueError(msg)
    end = config.updates if stop_at is None else stop_at
    if isinstance(end, bool) or not isinstance(end, int) or not 1 <= end <= config.updates:
        msg = f"stop_at={stop_at!r} must be an integer in [1, updates={config.updates}]"
        raise ValueError(msg)
    if resume_bug is not None and resume_bug not in RESUME_BUGS:
        msg = f"resume_bug={resume_bug!r} must be None or one of {RESUME_BUGS} (negative controls for tests only)"
        raise ValueError(msg)
    fault = parse_fault(os.environ.get(FAULT_ENV))
    if fault and fault.point != "in-window" and not _is_checkpoint_step(fault.step, config, end):
        msg = f"{FAULT_ENV}: step={fault.step} writes no checkpoint, so point={fault.point!r} would never be reached"
        raise ValueError(msg)
    say = log if log is not None else (print if rank == 0 else (lambda _m: None))
    the_recipe = load_recipe(recipe)  # a usage error names the path and the fix before anything is built
    device = _device(device_choice)

    rows = make_corpus(config)
    lock = data_lock(rows, config)
    plan = make_plan(rows, config)  # always the full run's plan: a stop at 50 must not change step 51's data

    # Seed before building anything: DDP broadcasts rank 0's weights, but each rank's dropout stream is its own.
    seed_rngs(config.seed, rank)
    module = build_model(config, dropout=config.dropout).to(device)
    model = DDPStrategy().wrap(module, device, count_syncs=False).module  # the loop trains under DDP
    model.train()
    setup = getattr(the_recipe, "setup", None)
    if setup is not None:
        setup()  # the recipe's per-rank objects that need the process group (an Accelerator, a device mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupLinearDecay(config.warmup, config.updates))

    start, losses = 0, []
    if resume is not None:
        shared, state = load_checkpoint(resume, config=config, data_lock=lock, rank=rank, world_size=world)
        model.module.load_state_dict(shared["model"])
        if resume_bug != "drop_optimizer":
            optimizer.load_state_dict(shared["optimizer"])
        scheduler.load_state_dict(shared["scheduler"])
        if resume_bug == "reseed":
            seed_rngs(config.seed, rank)
        elif resume_bug == "rank0_rng":
            _, state0 = load_checkpoint(resume, config=config, data_lock=lock, rank=0, world_size=world)
            set_rng_state(state0["rng"], device)
        else:
            set_rng_state(state["rng"], device)
        start = 0 if resume_bug == "restart_plan" else int(state["position"])
        losses = list(state["losses"])
        if start > end:
            msg = f"stop_at={end} lies before the checkpoint's step {start} ({resume}); stop later or resume earlier"
            raise ValueError(msg)
        say(f"resumed from {resume} at step {start}")

    written: list[str] = []
    for index in range(start, end):
        step = index + 1
        model.zero_grad(set_to_none=True)
        window = [collate([rows[i] for i in ids], device) for ids in plan[index][rank]]
        loss = _backward_window(the_recipe, model, window, fault, rank, step, run_dir)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss) if loss is not None else float("nan"))
        if step % 10 == 0 or step == end:
            say(f"step {step:4d}  loss {losses[-1]:.4f}  lr {scheduler.get_last_lr()[0]:.5f}")
        if _is_checkpoint_step(step, config, end):
            folder = _checkpoint(run_dir, step, model, optimizer, scheduler, config, lock, losses, device, fault)
            written.append(str(folder))

    summary: dict[str, Any] = {
        "rank": rank,
        "final_step": end,
        "start_step": start,
        "losses": losses,
        "checkpoints": written,
        "state": {
            "model": {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()},
            "optimizer": cpu_copy(optimizer.state_dict()),
            "scheduler": scheduler.state_dict(),
        },
    }
    if evaluate:
        result = evaluate_model(model.module, rows, config, device)
        if rank == 0:
            write_eval(run_dir, result, step=end)
            say(f"eval at step {end}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float)))
        summary["eval"] = result
    # A draw from every generator after the last step: Python's and numpy's streams do not shape this trainer's
    # numbers, but a user's code may use them, so the resume tests compare these draws as well.
    summary["rng_draws"] = (random.random(), float(np.random.random()), float(torch.rand(1)))
    del model, module  # before the process group goes away: a live DDP module can hang the rank's exit (FACTS.md)
    return summary


def _backward_window(
    recipe: Recipe, model: DDP, window: Sequence[Microbatch], fault: Fault | None, rank: int, step: int,
    run_dir: str | Path,
) -> float | None:
    if fault is None or fault.point != "in-window" or (fault.rank, fault.step) != (rank, step):
        return recipe.backward_window(model, window)
    # Kill on the second forward pass: after the first microbatch's backward, before the second's, whatever the
    # recipe does in between.
    calls = [0]

    def hook(_module: Any, _inputs: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            die_at(fault, rank, step, "in-window", run_dir)

    handle = model.module.register_forward_pre_hook(hook)
    try:
        return recipe.backward_window(model, window)
    finally:
        handle.remove()


def _checkpoint(
    run_dir: str | Path, step: int, model: DDP, optimizer: torch.optim.Optimizer, scheduler: Any, config: Config,
    lock: str, losses: list[float], device: torch.device, fault: Fault | None,
) -> Path:
    rank, world = dist.get_rank(), dist.get_world_size()
    shared = None
    if rank == 0:
        shared = {
            "step": step,
            "model": cpu_copy(model.module.state_dict()),
            "optimizer": cpu_copy(optimizer.state_dict()),
            "scheduler": scheduler.state_dict(),
            "config": config.to_dict(),
            "data_lock": lock,
        }
    state = {
        "rank": rank,
        "world_size": world,
        "position": step,  # the next step index into the plan
        "losses": list(losses),
        "rng": rng_state(device),
    }
    return save_checkpoint(
        run_dir, step, shared=shared, rank_state=state, rank=rank, world_size=world,
        point=lambda name: die_at(fault, rank, step, name, run_dir),
    )


def launched_run(
    config: Config | dict[str, Any], run_dir: str, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Rank body for :func:`harness.distributed.launcher.launch`:
    ``launch(launched_run, 2, config, run_dir, {"stop_at": 50})``.

    A module-level function of the package, so the launcher's forkserver has it preloaded. ``options`` (a dict,
    because the launcher passes positional arguments only) are :func:`run`'s keywords: ``stop_at``, ``resume``,
    ``recipe``, ``resume_bug``, ``evaluate``, ``device_choice`` (None, "cpu" or "cuda");
    ``resume="latest:<run dir>"`` resumes from that run directory's latest complete checkpoint, found inside the
    ranks, after whatever killed the previous run.
    """
    cfg = config if isinstance(config, Config) else Config(**config)
    kwargs = dict(options or {})
    resume = kwargs.get("resume")
    if isinstance(resume, str) and resume.startswith("latest:"):
        folder = latest_checkpoint(resume[len("latest:") :])
        if folder is None:
            msg = f"resume={resume!r}: that run directory holds no complete checkpoint (no valid manifest)"
            raise ValueError(msg)
        kwargs["resume"] = str(folder)
    kwargs.setdefault("log", _quiet)  # tests read the summary, not the console
    return run(cfg, run_dir, **kwargs)


def _quiet(_message: str) -> None:
    pass


# FAULT_*, Fault, parse_fault, WarmupLinearDecay, rank_seed and state_difference live in faults, schedule, rng and
# state; they stay importable from here, where the tests, the workflow and the benchmarks import them.
__all__ = [
    "FAULT_ENV",
    "FAULT_POINTS",
    "FAULT_RECORD",
    "RESUME_BUGS",
    "Fault",
    "WarmupLinearDecay",
    "launched_run",
    "parse_fault",
    "rank_seed",
    "run",
    "state_difference",
]

