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
:mod:`~harness.training.rng` (per-rank generators), :mod:`~harness.resume.faults` (``HARNESS_FAULT`` kill points),
:mod:`~harness.resume.state` (CPU copies and :func:`state_difference`), :mod:`~harness.resume.checkpoint` and
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
from harness.resume.checkpoint import (
    load_checkpoint,
    newest_valid_checkpoint,
    save_checkpoint,
    write_checkpoint_files,
)
from harness.resume.faults import FAULT_ENV, FAULT_POINTS, FAULT_RECORD, Fault, die_at, parse_fault
from harness.resume.state import cpu_copy, state_difference
from harness.training.evaluation import evaluate_model, write_eval
from harness.training.rng import rank_seed, rng_state, seed_rngs, set_rng_state
from harness.training.schedule import WarmupLinearDecay

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel as DDP

RESUME_BUGS = (
    "reseed", "drop_optimizer", "rank0_rng", "restart_plan", "python_numpy_rng", "optimizer_wrong_params",
    "scheduler_not_restored", "scheduler_stepped_again", "rng_consumed_after_restore", "position_off_by_one",
    "labels_from_0", "checkpoint_before_update", "not_atomic",
)
"""Negative controls, each a resume mistake seen in real loops: re-seed the RNGs instead of restoring them; do not
load the optimizer state (momentum lost); restore rank 0's RNG states on every rank; restart the plan from its first
step; restore torch's RNG but not Python's and numpy's; load momentum buffers onto the wrong parameters (two of the
same shape swapped); do not restore the scheduler; step the scheduler once more after loading it; draw from torch's
RNG after restoring it; record the data position one step short; restore the data position but count the steps (the
checkpoint labels) from 0 again; save the weights as they were before the step's update; keep each rank's state in one
``rank-R.latest.pt`` beside the step directories, overwritten in place at every save (not atomic with the
checkpoint: a kill inside a later save leaves the complete checkpoint pointing at newer state)."""

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


class HarnessTrainer:
    """The harness's own trainer, one optimizer step at a time: an implementation of the resume battery's trainer
    contract (``step``, ``save(folder)``, ``load(folder)``, ``state()``; :mod:`harness.resume.contract`), and the
    loop :func:`run` drives. Built on every rank inside the process group; ``bug`` is one of :data:`RESUME_BUGS`
    (negative controls for tests only)."""

    def __init__(self, config: Config, *, recipe: Recipe | str | None = None, bug: str | None = None,
                 device_choice: str | None = None, fault: Fault | None = None, run_dir: str | Path = ".") -> None:
        if not dist.is_initialized():
            msg = "trainer.run must be called on every rank inside an initialized process group (launcher or torchrun)"
            raise RuntimeError(msg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != config.world_size:
            msg = (f"world_size={self.world} (ranks started) differs from config world_size={config.world_size}; "
                   "start that many")
            raise ValueError(msg)
        if bug is not None and bug not in RESUME_BUGS:
            msg = f"resume_bug={bug!r} must be None or one of {RESUME_BUGS} (negative controls for tests only)"
            raise ValueError(msg)
        self.config, self.bug, self.fault, self.run_dir = config, bug, fault, Path(run_dir)
        self.recipe = load_recipe(recipe)  # a usage error names the path and the fix before anything is built
        self.device = _device(device_choice)
        self.rows = make_corpus(config)
        self.lock = data_lock(self.rows, config)
        self.plan = make_plan(self.rows, config)  # always the full run's plan: a stop at 50 must not change step 51
        # Seed before building anything: DDP broadcasts rank 0's weights, but each rank's dropout stream is its own.
        seed_rngs(config.seed, self.rank)
        self.module = build_model(config, dropout=config.dropout).to(self.device)
        self.model = DDPStrategy().wrap(self.module, self.device, count_syncs=False).module  # trains under DDP
        self.model.train()
        setup = getattr(self.recipe, "setup", None)
        if setup is not None:
            setup()  # the recipe's per-rank objects that need the process group (an Accelerator, a device mesh)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=config.lr, momentum=config.momentum)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, WarmupLinearDecay(config.warmup, config.updates))
        self.position = 0  # the next step index into the plan: where this rank's data resumes
        self.steps = 0  # optimizer steps taken: what the checkpoints are labelled with
        self.losses: list[float] = []
        self._before_update: dict[str, Any] | None = None

    # -- the contract

    def step(self) -> float:
        """One optimizer step on this rank's window of the plan; returns the logged loss (NaN if none)."""
        if self.position >= len(self.plan):
            msg = f"the plan has {len(self.plan)} steps (updates={self.config.updates}); no step {self.position + 1}"
            raise ValueError(msg)
        self.model.zero_grad(set_to_none=True)
        window = [collate([self.rows[i] for i in ids], self.device) for ids in self.plan[self.position][self.rank]]
        loss = _backward_window(self.recipe, self.model, window, self.fault, self.rank, self.steps + 1, self.run_dir)
        if self.bug == "checkpoint_before_update":
            self._before_update = cpu_copy(self.module.state_dict())
        self.optimizer.step()
        self.scheduler.step()
        self.position += 1
        self.steps += 1
        self.losses.append(float(loss) if loss is not None else float("nan"))
        return self.losses[-1]

    def save(self, folder: str | Path, point: Callable[[str], None] | None = None) -> None:
        """This rank's files into ``folder`` (collective: every rank calls it; no manifest: the caller commits)."""
        shared = self.shared_state() if self.rank == 0 else None
        state = self.rank_state()
        if self.bug == "not_atomic":
            # The mistake: part of the checkpoint lives in one file per rank, overwritten in place at every save.
            torch.save(state, Path(folder).parent / f"rank-{self.rank}.latest.pt")
        write_checkpoint_files(Path(folder), shared=shared, rank_state=state, rank=self.rank, point=point)

    def load(self, folder: str | Path) -> None:
        """Restore every piece of state from the step directory ``folder`` (validated against this run)."""
        config, rank, world = self.config, self.rank, self.world
        shared, state = load_checkpoint(folder, config=config, data_lock=self.lock, rank=rank, world_size=world)
        if self.bug == "not_atomic":
            state = torch.load(Path(folder).parent / f"rank-{rank}.latest.pt", map_location="cpu",
                               weights_only=True)
        self.module.load_state_dict(shared["model"])
        if self.bug == "optimizer_wrong_params":
            shared["optimizer"] = _swap_same_shaped(shared["optimizer"])
        if self.bug != "drop_optimizer":
            self.optimizer.load_state_dict(shared["optimizer"])
        if self.bug != "scheduler_not_restored":
            self.scheduler.load_state_dict(shared["scheduler"])
        if self.bug == "scheduler_stepped_again":
            self.scheduler.step()
        if self.bug == "reseed":
            seed_rngs(config.seed, rank)
        elif self.bug == "rank0_rng":
            _, state0 = load_checkpoint(folder, config=config, data_lock=self.lock, rank=0, world_size=world)
            set_rng_state(state0["rng"], self.device)
        elif self.bug == "python_numpy_rng":
            torch.set_rng_state(state["rng"]["torch"])
        else:
            set_rng_state(state["rng"], self.device)
        if self.bug == "rng_consumed_after_restore":
            torch.rand(1)
        self.position = 0 if self.bug == "restart_plan" else int(state["position"])
        self.steps = 0 if self.bug == "labels_from_0" else int(state["position"])
        self.losses = list(state["losses"])

    def state(self) -> dict[str, Any]:
        """Everything that must match after a resume, as CPU copies: the step count, the data position, the loss
        history, the model, the optimizer (momentum buffers) and the scheduler. The global generators (the only
        ones this trainer draws from: dropout) are compared by the battery itself."""
        return {
            "step": self.steps,
            "position": self.position,
            "losses": list(self.losses),
            "model": {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()},
            "optimizer": cpu_copy(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
        }

    # -- the harness's file format

    def shared_state(self) -> dict[str, Any]:
        model = self._before_update if self._before_update is not None else cpu_copy(self.module.state_dict())
        return {
            "step": self.steps,
            "model": model,
            "optimizer": cpu_copy(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "config": self.config.to_dict(),
            "data_lock": self.lock,
        }

    def rank_state(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world,
            "position": self.position - 1 if self.bug == "position_off_by_one" else self.position,
            "losses": list(self.losses),
            "rng": rng_state(self.device),
        }

    def close(self) -> None:
        """Drop the DDP module before the process group goes away: a live one can hang the rank's exit (FACTS.md)."""
        del self.model, self.module


def _swap_same_shaped(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state with the buffers of same-shaped parameters handed round in reverse: state matched to the
    wrong parameters (what loading by position after a change in parameter order does)."""
    state = dict(optimizer_state["state"])
    by_shape: dict[tuple[int, ...], list[Any]] = {}
    for index, entry in state.items():
        by_shape.setdefault(tuple(entry["momentum_buffer"].shape), []).append(index)
    for indices in by_shape.values():
        for a, b in zip(indices, reversed(indices)):
            state[a] = optimizer_state["state"][b]
    return {**optimizer_state, "state": state}


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
    end = config.updates if stop_at is None else stop_at
    if isinstance(end, bool) or not isinstance(end, int) or not 1 <= end <= config.updates:
        msg = f"stop_at={stop_at!r} must be an integer in [1, updates={config.updates}]"
        raise ValueError(msg)
    fault = parse_fault(os.environ.get(FAULT_ENV))
    if fault and fault.point != "in-window" and not _is_checkpoint_step(fault.step, config, end):
        msg = f"{FAULT_ENV}: step={fault.step} writes no checkpoint, so point={fault.point!r} would never be reached"
        raise ValueError(msg)
    trainer = HarnessTrainer(config, recipe=recipe, bug=resume_bug, device_choice=device_choice, fault=fault,
                             run_dir=run_dir)
    rank = trainer.rank
    say = log if log is not None else (print if rank == 0 else (lambda _m: None))
    start = 0
    if resume is not None:
        trainer.load(resume)
        start = trainer.position
        if start > end:
            msg = f"stop_at={end} lies before the checkpoint's step {start} ({resume}); stop later or resume earlier"
            raise ValueError(msg)
        say(f"resumed from {resume} at step {start}")

    written: list[str] = []
    for _ in range(start, end):
        trainer.step()
        step = trainer.steps
        if step % 10 == 0 or trainer.position == end:
            say(f"step {step:4d}  loss {trainer.losses[-1]:.4f}  lr {trainer.scheduler.get_last_lr()[0]:.5f}")
        if _is_checkpoint_step(trainer.position, config, end):

            def point(name: str, step: int = step) -> None:
                die_at(fault, rank, step, name, run_dir)

            folder = save_checkpoint(
                run_dir, step, shared=trainer.shared_state() if rank == 0 else None, rank_state=trainer.rank_state(),
                rank=rank, world_size=trainer.world, point=point,
            )
            written.append(str(folder))

    state = trainer.state()
    summary: dict[str, Any] = {
        "rank": rank,
        "final_step": end,
        "start_step": start,
        "losses": trainer.losses,
        "checkpoints": written,
        "state": {part: state[part] for part in ("model", "optimizer", "scheduler")},
    }
    if evaluate:
        result = evaluate_model(trainer.module, trainer.rows, config, trainer.device)
        if rank == 0:
            write_eval(run_dir, result, step=end)
            say(f"eval at step {end}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float)))
        summary["eval"] = result
    # A draw from every generator after the last step: Python's and numpy's streams do not shape this trainer's
    # numbers, but a user's code may use them, so the resume tests compare these draws as well.
    summary["rng_draws"] = (random.random(), float(np.random.random()), float(torch.rand(1)))
    trainer.close()
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


def trainer_factory(config: str | Path | None = None, **options: Any) -> HarnessTrainer:
    """``--trainer=harness.training.trainer:trainer_factory``: the harness's trainer for the resume battery, on
    ``configs/minimum.yaml`` with the world size of the ranks started, or on ``config`` as it is (which refuses
    another world size). ``options`` are :class:`HarnessTrainer`'s keywords (``bug=``)."""
    from harness.data.config import load_config

    if config is not None:
        return HarnessTrainer(load_config(Path(config)), **options)
    # The default config's world size is its torchrun run's; the battery's ranks are as many as --resume-world-size
    # says, and the plan deals the same corpus to however many there are.
    default = load_config(Path(__file__).resolve().parents[2] / "configs" / "minimum.yaml")
    return HarnessTrainer(default.replace(world_size=dist.get_world_size()), **options)


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
        folder = newest_valid_checkpoint(resume[len("latest:") :]).folder
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
    "HarnessTrainer",
    "WarmupLinearDecay",
    "launched_run",
    "parse_fault",
    "rank_seed",
    "run",
    "state_difference",
]

