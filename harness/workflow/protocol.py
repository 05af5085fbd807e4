"""The steps ``report`` runs, each also a command of its own: prepare, reference, gradient parity, the resume trio
and evaluation.

A bad input (another data lock, an invalid config, an incomplete checkpoint) is detected before the step writes
anything; every file a step writes goes through :mod:`harness.workflow.outputs`' atomic writers.

Rank bodies (``window_gradients``, ``evaluate_checkpoint``) are module-level functions so that
:func:`harness.distributed.launcher.launch` can run them on warm forkserver ranks.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.core.compare import Comparison, compare, flat_grad
from harness.core.microbatch import Microbatch
from harness.core.reference import reference_gradient
from harness.data.batching import collate
from harness.data.config import Config
from harness.data.corpus import Row, data_lock, make_corpus
from harness.data.plan import Plan, make_plan
from harness.distributed.launcher import launch
from harness.model import build_model
from harness.resume.checkpoint import MANIFEST, SHARED, read_manifest, step_dir_name, step_dirs
from harness.workflow.outputs import (
    MARKER,
    BadInput,
    Progress,
    check_lock,
    read_marker,
    write_bytes,
    write_json,
    write_text,
)

MEAN_OF_MEANS = "harness.recipes:mean_of_local_means"
DEADLINE = 300.0
"""Seconds one launched run may take before it is called hung. benchmarks/results/torchrun_trio.json measured the
whole trio (three torchrun runs of configs/minimum.yaml) at a median of 16.4 s on 2 cores; 300 s is far beyond."""


# ------------------------------------------------------------------------------------------------------ prepare


@dataclass(frozen=True)
class Prepared:
    rows: list[Row]
    lock: str
    plan: Plan


PREPARED_FILES = ("data/corpus.jsonl", "data/plan.json", MARKER)
"""What :func:`prepare` writes, relative to the outputs folder."""


def prepare(config: Config, outputs: Path, config_path: str) -> Prepared:
    """Corpus, plan and data lock under ``outputs``; refuses a folder made from another data lock, untouched."""
    rows = make_corpus(config)
    lock = data_lock(rows, config)
    check_lock(outputs, lock, config_path)
    plan = make_plan(rows, config)
    outputs.mkdir(parents=True, exist_ok=True)
    corpus = "".join(
        json.dumps({"id": r.id, "split": r.split, "prompt_len": r.prompt_len, "tokens": list(r.tokens)}) + "\n"
        for r in rows
    )
    write_text(outputs / "data" / "corpus.jsonl", corpus)
    write_json(outputs / "data" / "plan.json", plan)
    # The marker goes last: a folder whose marker exists holds the whole prepared data.
    write_json(outputs / MARKER, {"data_lock": lock, "config": config_path, "settings": config.to_dict()})
    return Prepared(rows, lock, plan)


def require_prepared(config: Config, outputs: Path, config_path: str) -> Prepared:
    rows = make_corpus(config)
    lock = data_lock(rows, config)
    if read_marker(outputs) is None:
        msg = (
            f"--outputs {str(outputs)!r} holds no prepared data ({MARKER} is missing); run "
            f"`python -m harness prepare --config {config_path} --outputs {outputs}` first"
        )
        raise BadInput(msg)
    check_lock(outputs, lock, config_path)
    return Prepared(rows, lock, make_plan(rows, config))


def plan_token_counts(prepared: Prepared) -> list[list[int]]:
    """Supervised tokens per window and rank over the whole plan (for the figure)."""
    out = []
    for step in prepared.plan:
        out.append([sum(prepared.rows[i].supervised for mb in rank for i in mb) for rank in step])
    return out


# ---------------------------------------------------------------------------------------------------- reference


def parity_window(config: Config, prepared: Prepared) -> list[list[Microbatch]]:
    """The plan's first window: rank r's microbatches from the r-th length band (uneven token counts)."""
    return [[collate([prepared.rows[i] for i in ids]) for ids in rank] for rank in prepared.plan[0]]


def token_counts(window: Sequence[Sequence[Microbatch]]) -> list[int]:
    return [sum(mb.supervised for mb in rank) for rank in window]


REFERENCE_FILES = ("reference/reference.pt", "reference/reference.json")


def compute_reference(config: Config, outputs: Path, prepared: Prepared) -> dict[str, Any]:
    """The single-device gradient of the first window from the initial weights; saved under ``outputs/reference``."""
    window = parity_window(config, prepared)
    # Dropout 0: the control and the ranks must compute the same function (masks would differ between the paths).
    ref = reference_gradient(build_model(config, dropout=0.0), window)
    summary = {
        "window": 0,
        "world_size": len(window),
        "rank_tokens": token_counts(window),
        "tokens": ref.tokens,
        "loss": ref.loss,
        "components": int(ref.gradient.numel()),
        "gradient_norm": float(ref.gradient.double().norm()),
    }
    buf = io.BytesIO()
    torch.save({"gradient": ref.gradient, **summary}, buf)
    write_bytes(outputs / REFERENCE_FILES[0], buf.getvalue())
    write_json(outputs / REFERENCE_FILES[1], summary)
    return summary


def load_reference(outputs: Path) -> dict[str, Any]:
    path = outputs / REFERENCE_FILES[0]
    if not path.is_file():
        msg = f"{path} is missing; run `python -m harness reference --outputs {outputs}` first"
        raise BadInput(msg)
    return dict(torch.load(path, map_location="cpu", weights_only=True))


# ------------------------------------------------------------------------------------------------------- parity


def window_gradients(config: Config, recipe_path: str, windows: list[list[list[Microbatch]]]) -> list[dict[str, Any]]:
    """Rank body: ``recipe``'s synchronized gradient for each window, from the initial weights every time."""
    from harness.distributed import strategies
    from harness.recipes import load_recipe

    rank = dist.get_rank()
    recipe = load_recipe(recipe_path)
    model = build_model(config, dropout=0.0)
    ddp = strategies.get("ddp").wrap(model, torch.device("cpu"), count_syncs=False).module
    ddp.train()
    out = []
    for window in windows:
        for p in model.parameters():
            p.grad = None
        logged = recipe.backward_window(ddp, window[rank])  # no optimizer step: every window sees the same weights
        out.append({"grad": flat_grad(model), "logged": None if logged is None else float(logged)})
    del ddp  # before the process group goes away: a DDP module still alive then can keep the rank from exiting
    return out


def ddp_parity(config: Config, recipe: str, windows: list[list[list[Microbatch]]],
               references: Sequence[torch.Tensor]) -> list[tuple[Comparison, torch.Tensor]]:
    """Per window: the worst rank's comparison with its reference, and rank 0's gradient."""
    results = launch(window_gradients, len(windows[0]), config, recipe, windows, deadline=DEADLINE)
    out = []
    for k, ref in enumerate(references):
        comparisons = [compare(r[k]["grad"], ref) for r in results]
        out.append((max(comparisons, key=lambda c: c.worst_ratio), results[0][k]["grad"]))
    return out


# ----------------------------------------------------------------------------------------------------- evaluate


def evaluate_checkpoint(config: Config, step_dir: str) -> dict[str, Any]:
    """Rank body: load ``step_dir``'s weights and evaluate them on this rank's shard; sums are all-reduced."""
    from harness.training.evaluation import evaluate_model

    shared = torch.load(Path(step_dir) / SHARED, map_location="cpu", weights_only=True)
    model = build_model(config, dropout=0.0)
    model.load_state_dict(shared["model"])
    return evaluate_model(model, make_corpus(config), config, torch.device("cpu"), splits=("test",))


def checkpoint_to_evaluate(run_dir: Path) -> Path:
    """The newest step directory of ``run_dir``, refused (BadInput) when it is incomplete or there is none."""
    if not run_dir.is_dir():
        msg = f"--run-dir {str(run_dir)!r} is not a directory; pass a run directory such as outputs/runs/continuous"
        raise BadInput(msg)
    folders = step_dirs(run_dir)
    if not folders:
        msg = f"--run-dir {str(run_dir)!r} holds no step-NNNN checkpoint; train first (report, or harness.train)"
        raise BadInput(msg)
    newest = folders[0]
    try:
        read_manifest(newest)
    except ValueError as exc:
        # Evaluating an older step silently would report numbers for a model the user did not mean.
        msg = (f"--run-dir {str(run_dir)!r}: its newest checkpoint {newest.name} is incomplete or damaged ({exc}); "
               "run check-checkpoints on it, or pass --checkpoint with a complete step directory")
        raise BadInput(msg) from None
    return newest


def evaluate(config: Config, step_dir: Path, lock: str) -> dict[str, Any]:
    """Test loss, token accuracy and valid tokens of ``step_dir``'s weights, on ``config.world_size`` ranks."""
    from harness.resume.checkpoint import load_checkpoint

    manifest = read_manifest(step_dir)
    try:
        load_checkpoint(step_dir, config=config, data_lock=lock, rank=0, world_size=int(manifest["world_size"]))
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    (result, *_) = launch(evaluate_checkpoint, config.world_size, config, str(step_dir), deadline=DEADLINE)
    return {"checkpoint": str(step_dir), "step": int(manifest["step"]), "world_size": config.world_size, **result}


# ---------------------------------------------------------------------------------------------------------- trio


def trio(config: Config, runs: Path, progress: Progress) -> dict[str, Any]:
    """Stop at ``stop_at``, train continuously to ``updates``, resume the stopped run; how far resumed and continuous
    end apart (model, optimizer, scheduler) and whether their loss histories are equal."""
    from harness.training.trainer import launched_run, state_difference

    progress(f"  stop at {config.stop_at} on {config.world_size} ranks")
    stopped = launch(launched_run, config.world_size, config, str(runs / "stopped"), {"stop_at": config.stop_at},
                     deadline=DEADLINE)
    progress(f"  continuous to {config.updates}")
    continuous = launch(launched_run, config.world_size, config, str(runs / "continuous"), {}, deadline=DEADLINE)
    step_dir = runs / "stopped" / step_dir_name(config.stop_at)
    progress(f"  resume from {step_dir.name} to {config.updates}")
    resumed = launch(launched_run, config.world_size, config, str(runs / "resumed"), {"resume": str(step_dir)},
                     deadline=DEADLINE)
    parts = {
        part: max(state_difference(a["state"][part], b["state"][part]) for a, b in zip(continuous, resumed))
        for part in ("model", "optimizer", "scheduler")
    }
    return {
        "stop_at": config.stop_at,
        "stopped_final_step": stopped[0]["final_step"],
        "stopped_checkpoint_complete": (step_dir / MANIFEST).is_file(),
        "updates": config.updates,
        "resumed_start_step": resumed[0]["start_step"],
        "max_abs_difference": parts,
        "max_abs_difference_all": max(parts.values()),
        "losses_equal": all(a["losses"] == b["losses"] for a, b in zip(continuous, resumed)),
        "continuous_losses": continuous[0]["losses"],
        "resumed_losses": resumed[0]["losses"],
    }
