"""Seed 000's r1 workflow as steps the command line runs, and the report that answers its three questions.

The questions: does the DDP gradient match the single-device one, does a resumed run land on the continuous run's
bits, and what does the trained model reach on test data. Every number in ``report.md`` / ``report.json`` is computed
by the steps below in the same invocation; none is copied from the seed.

Layout of an outputs folder (``--outputs``, default ``outputs/``)::

    outputs.json            marker: the data lock and config the folder was prepared from (clean and prepare read it)
    data/corpus.jsonl       every row of every split
    data/plan.json          plan[step][rank][microbatch] -> sequence ids
    reference/              the single-device control gradient (reference.pt) and its summary (reference.json)
    runs/{stopped,continuous,resumed}/step-NNNN   the trio's checkpoints
    report.md  report.json  report.png

Why files are written the way they are: a bad input (another data lock, an invalid config, an incomplete checkpoint)
is detected before anything is written, and whatever is written goes to a temporary name first and is renamed over
the final name at the end, so a failed or interrupted command never leaves a half-written file where a whole one was.

Rank bodies (``window_gradients``, ``evaluate_checkpoint``, ``timed_training``) are module-level functions of the
package so that :func:`harness.dist.launcher.launch` can run them on warm forkserver ranks.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from harness.dist.launcher import launch
from harness.model import build_model
from harness.recipes import CORRECT_RECIPE
from harness.training.checkpoint import MANIFEST, SHARED, read_manifest, step_dir_name, write_atomic

MARKER = "outputs.json"
MEAN_OF_MEANS = "harness.recipes:mean_of_local_means"
DEADLINE = 300.0
"""Seconds one launched run may take: the trio's runs take ~15 s each on a 2-core machine; far beyond is a hang."""

SCALING_WORLDS = (1, 2, 4)
SCALING_STEPS = 20
"""Timed optimizer steps per world size: enough to dwarf the launch, small enough to keep the report quick."""
SCALING_WARMUP = 2
"""Untimed steps first: DDP rebuilds its buckets after the first iteration, and the first pass pays lazy imports."""

EXERCISE_RANK0 = 12
EXERCISE_RANK1 = (12, 36)
"""Seed 000's exercise: rank 0 keeps 12 supervised tokens, rank 1 goes from 12 to 36."""


class BadInput(ValueError):
    """The user's input cannot be used as given (another data lock, a missing step, an incomplete checkpoint)."""


Progress = Callable[[str], None]


def _silent(_message: str) -> None:
    pass


def stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ writing safely


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` through a temporary name in the same folder (never half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode())


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _swap_dir(new: Path, final: Path) -> None:
    """Put the folder ``new`` in place of ``final``: the old one is moved aside first, then deleted."""
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


def _temp_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


# ------------------------------------------------------------------------------------------------------ prepare


@dataclass(frozen=True)
class Prepared:
    rows: list[Row]
    lock: str
    plan: Plan


def read_marker(outputs: Path) -> dict[str, Any] | None:
    path = outputs / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
        str(marker["data_lock"])
    except (ValueError, KeyError, TypeError) as exc:
        msg = f"{path}: not a valid outputs marker ({exc!r}); remove {outputs} or pass another --outputs"
        raise BadInput(msg) from None
    return dict(marker)


def check_lock(outputs: Path, lock: str, config_path: str) -> None:
    """Refuse an outputs folder prepared from other data: mixing two corpora would make every comparison meaningless."""
    marker = read_marker(outputs)
    if marker is not None and marker["data_lock"] != lock:
        msg = (
            f"--outputs {str(outputs)!r} was prepared from data lock {marker['data_lock']} "
            f"(config {marker.get('config', '?')}), but --config {config_path} gives data lock {lock}; "
            "pass another --outputs, or remove that folder (clean --scope generated --yes) to start over"
        )
        raise BadInput(msg)


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


# ---------------------------------------------------------------------------------------------------- reference


def parity_window(config: Config, prepared: Prepared) -> list[list[Microbatch]]:
    """The plan's first window: rank r's microbatches from the r-th length band (uneven token counts)."""
    return [[collate([prepared.rows[i] for i in ids]) for ids in rank] for rank in prepared.plan[0]]


def token_counts(window: Sequence[Sequence[Microbatch]]) -> list[int]:
    return [sum(mb.supervised for mb in rank) for rank in window]


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
    folder = outputs / "reference"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".reference.pt.tmp-{os.getpid()}"
    torch.save({"gradient": ref.gradient, **summary}, tmp)
    os.replace(tmp, folder / "reference.pt")
    write_json(folder / "reference.json", summary)
    return summary


def load_reference(outputs: Path) -> dict[str, Any]:
    path = outputs / "reference" / "reference.pt"
    if not path.is_file():
        msg = f"{path} is missing; run `python -m harness reference --outputs {outputs}` first"
        raise BadInput(msg)
    return dict(torch.load(path, map_location="cpu", weights_only=True))


# ------------------------------------------------------------------------------------------------------- parity


def window_gradients(config: Config, recipe_path: str, windows: list[list[list[Microbatch]]]) -> list[dict[str, Any]]:
    """Rank body: ``recipe``'s synchronized gradient for each window, from the initial weights every time."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from harness.recipes import load_recipe

    rank = dist.get_rank()
    recipe = load_recipe(recipe_path)
    model = build_model(config, dropout=0.0)
    ddp = DDP(model)
    ddp.train()
    out = []
    for window in windows:
        for p in model.parameters():
            p.grad = None
        logged = recipe.backward_window(ddp, window[rank])  # no optimizer step: every window sees the same weights
        out.append({"grad": flat_grad(model), "logged": None if logged is None else float(logged)})
    del ddp  # before the process group goes away (FACTS.md: a live DDP module can hang the rank's exit)
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


# ------------------------------------------------------------------------------------------------------ exercise


def exercise_windows(config: Config, rows: Sequence[Row]) -> tuple[list[list[list[Microbatch]]], list[list[int]]]:
    """Two real windows for two ranks: rank 0 holds 12 supervised tokens in both; rank 1 holds 12, then 36.

    Rank 1's 36 tokens extend the same sequences that gave its 12 (longer prefixes of the same rows), so what
    changes is how many tokens it carries, not which kind.
    """
    acc = config.accumulation
    for n in (EXERCISE_RANK0, *EXERCISE_RANK1):
        if n % acc:
            msg = f"accumulation={acc} must divide the exercise's token counts 12 and 36; set 1, 2, 3, 4, 6 or 12"
            raise BadInput(msg)
    need = max(EXERCISE_RANK1) // acc + 1
    # No prompt: every target of a truncated row is supervised, so k + 1 tokens give exactly k.
    usable = [r for r in rows if r.split == "train" and r.prompt_len == 0 and len(r.tokens) >= need]
    if len(usable) < 2 * acc:
        msg = (f"the corpus has {len(usable)} prompt-free training rows of at least {need} tokens, the exercise needs "
               f"{2 * acc}; raise train_size or max_len, or lower prompt_fraction")
        raise BadInput(msg)

    def rank_window(chosen: Sequence[Row], tokens: int) -> list[Microbatch]:
        per = tokens // acc
        mbs = []
        for r in chosen:
            mb = collate([Row(r.id, r.split, r.tokens[: per + 1], 0)])
            assert mb.supervised == per
            mbs.append(mb)
        return mbs

    rank0, rank1 = usable[:acc], usable[acc : 2 * acc]
    windows = [[rank_window(rank0, EXERCISE_RANK0), rank_window(rank1, n1)] for n1 in EXERCISE_RANK1]
    return windows, [token_counts(w) for w in windows]


def _local_losses(config: Config, window: Sequence[Sequence[Microbatch]]) -> tuple[list[float], list[int]]:
    from harness.core.loss import loss_sum

    model = build_model(config, dropout=0.0)
    with torch.no_grad():
        sums = [sum(float(loss_sum(model(mb.inputs), mb.labels).double()) for mb in rank) for rank in window]
    return sums, token_counts(window)


def run_exercise(config: Config, progress: Progress = _silent) -> dict[str, Any]:
    """Seed 000's exercise on real ranks: how each average moves, and the gradients both normalizations produce."""
    if config.world_size != 2:
        msg = f"world_size={config.world_size}: the exercise is written for two ranks; set world_size: 2 in the config"
        raise BadInput(msg)
    rows = make_corpus(config)
    windows, counts = exercise_windows(config, rows)
    # The seed's hand calculation: 1 per token on rank 0, 3 on rank 1, before and after.
    seed = []
    for n0, n1 in counts:
        sums = [1.0 * n0, 3.0 * n1]
        seed.append({"tokens": [n0, n1], "mean_of_means": (sums[0] / n0 + sums[1] / n1) / 2,
                     "global_mean": (sums[0] + sums[1]) / (n0 + n1)})
    measured = []
    refs = []
    for window in windows:
        sums, n = _local_losses(config, window)
        means = [s / c for s, c in zip(sums, n)]
        measured.append({"tokens": n, "local_means": means, "mean_of_means": sum(means) / len(means),
                         "global_mean": sum(sums) / sum(n), "short_rank_weight_mean_of_means": 0.5,
                         "short_rank_weight_global": n[0] / sum(n)})
        refs.append(reference_gradient(build_model(config, dropout=0.0), window).gradient)
    gradients: dict[str, dict[str, Any]] = {}
    for recipe in (CORRECT_RECIPE, MEAN_OF_MEANS):
        progress(f"  exercise: {recipe.split(':')[-1]} on 2 ranks, layouts {counts}")
        result = ddp_parity(config, recipe, windows, refs)
        rows_out = []
        for k, (c, grad) in enumerate(result):
            rows_out.append({"tokens": counts[k], "gradient_norm": float(grad.double().norm()),
                             "max_abs_error": c.max_abs_error, "worst_ratio": c.worst_ratio,
                             "over_tolerance": c.over_tolerance, "matches_reference": c.passed})
        moved = float((result[1][1].double() - result[0][1].double()).abs().max())
        gradients[recipe.split(":")[-1]] = {"layouts": rows_out, "moved_max_abs": moved}
    good = [row["matches_reference"] for row in gradients["global_token_mean"]["layouts"]]
    control = [row["matches_reference"] for row in gradients["mean_of_local_means"]["layouts"]]
    # Equal counts make the two normalizations coincide; only the uneven layout can tell them apart.
    holds = good == [True, True] and control == [True, False]
    return {"seed_arithmetic": seed, "measured": measured, "gradients": gradients,
            "components": int(refs[0].numel()), "passed": bool(holds)}


# ----------------------------------------------------------------------------------------------------- evaluate


def evaluate_checkpoint(config: Config, step_dir: str) -> dict[str, Any]:
    """Rank body: load ``step_dir``'s weights and evaluate them on this rank's shard; sums are all-reduced."""
    from harness.training.evaluation import evaluate_model

    shared = torch.load(Path(step_dir) / SHARED, map_location="cpu", weights_only=True)
    model = build_model(config, dropout=0.0)
    model.load_state_dict(shared["model"])
    return evaluate_model(model, make_corpus(config), config, torch.device("cpu"), splits=("test",))


def step_dirs(run_dir: Path) -> list[Path]:
    import re

    pattern = re.compile(r"^step-(\d{4,})$")
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := pattern.match(p.name))]
    return [p for _, p in sorted(found)]


def checkpoint_problems(run_dir: Path) -> list[tuple[Path, str]]:
    """``(step dir, why)`` for every step directory of ``run_dir`` whose manifest does not vouch for its files."""
    problems = []
    for folder in step_dirs(run_dir):
        try:
            read_manifest(folder)
        except ValueError as exc:
            problems.append((folder, str(exc)))
    return problems


def checkpoint_to_evaluate(run_dir: Path) -> Path:
    """The newest step directory of ``run_dir``, refused (BadInput) when it is incomplete or there is none."""
    if not run_dir.is_dir():
        msg = f"--run-dir {str(run_dir)!r} is not a directory; pass a run directory such as outputs/runs/continuous"
        raise BadInput(msg)
    folders = step_dirs(run_dir)
    if not folders:
        msg = f"--run-dir {str(run_dir)!r} holds no step-NNNN checkpoint; train first (report, or harness.train)"
        raise BadInput(msg)
    newest = folders[-1]
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
    from harness.training.checkpoint import load_checkpoint

    manifest = read_manifest(step_dir)
    try:
        load_checkpoint(step_dir, config=config, data_lock=lock, rank=0, world_size=int(manifest["world_size"]))
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    (result, *_) = launch(evaluate_checkpoint, config.world_size, config, str(step_dir), deadline=DEADLINE)
    return {"checkpoint": str(step_dir), "step": int(manifest["step"]), "world_size": config.world_size, **result}


# ------------------------------------------------------------------------------------------------------ scaling


def timed_training(config: Config, steps: int, warmup: int) -> dict[str, float]:
    """Rank body: ``warmup`` untimed then ``steps`` timed optimizer steps of the correct recipe; global tokens/s."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from harness.core.loss import global_count
    from harness.recipes import global_token_mean

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = make_corpus(config)
    plan = make_plan(rows, config, world_size=world, steps=warmup + steps)
    model = build_model(config, dropout=0.0)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=config.momentum)
    tokens, start = 0, 0.0
    for index in range(warmup + steps):
        if index == warmup:
            dist.barrier()  # every rank starts the clock together
            start = time.perf_counter()
        window = [collate([rows[i] for i in ids]) for ids in plan[index][rank]]
        if index >= warmup:
            tokens += sum(mb.supervised for mb in window)
        ddp.zero_grad(set_to_none=True)
        global_token_mean.backward_window(ddp, window)
        optimizer.step()
    dist.barrier()  # the slowest rank sets the pace of a synchronous step
    elapsed = time.perf_counter() - start
    total = global_count(tokens)
    del ddp
    return {"tokens": float(total), "seconds": elapsed}


def scaling(config: Config, worlds: Sequence[int] = SCALING_WORLDS, steps: int = SCALING_STEPS,
            progress: Progress = _silent) -> list[dict[str, Any]]:
    """Seed 003's scaling efficiency ``throughput_W / (W * throughput_1)`` at each world size, on this CPU."""
    for w in worlds:
        make_plan(make_corpus(config), config, world_size=w, steps=1)  # a world size the corpus cannot feed: say so
    rows = []
    for w in worlds:
        progress(f"  scaling: {steps} steps on {w} rank(s)")
        (result, *_) = launch(timed_training, w, config, steps, SCALING_WARMUP, deadline=DEADLINE)
        rows.append({"world_size": w, "steps": steps, "tokens": int(result["tokens"]), "seconds": result["seconds"],
                     "tokens_per_s": result["tokens"] / result["seconds"]})
    base = next((r["tokens_per_s"] for r in rows if r["world_size"] == 1), None)
    for r in rows:
        r["efficiency"] = None if base is None else r["tokens_per_s"] / (r["world_size"] * base)
    return rows


# ------------------------------------------------------------------------------------------------------- report


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class Report:
    config_path: str
    outputs: Path
    results: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]


def _trio(config: Config, runs: Path, progress: Progress) -> dict[str, Any]:
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


def plan_token_counts(prepared: Prepared) -> list[list[int]]:
    """Supervised tokens per window and rank over the whole plan (for the figure)."""
    out = []
    for step in prepared.plan:
        out.append([sum(prepared.rows[i].supervised for mb in rank for i in mb) for rank in step])
    return out


def run_report(config: Config, config_path: str, outputs: Path, progress: Progress = stderr_progress,
               scaling_worlds: Sequence[int] = SCALING_WORLDS, scaling_steps: int = SCALING_STEPS,
               controls: Sequence[str] | None = None) -> Report:
    """The whole protocol; writes report.md, report.json and report.png into ``outputs`` and returns the report.

    ``controls`` limits the battery's negative controls (default: every one in ``harness.recipes.NEGATIVE_CONTROLS``).
    """
    from harness.battery import plan
    from harness.battery.table import format_controls, format_table, run_cases, run_controls
    from harness.recipes import NEGATIVE_CONTROLS

    chosen = list(NEGATIVE_CONTROLS if controls is None else controls)
    unknown = [c for c in chosen if c not in NEGATIVE_CONTROLS]
    if unknown or not chosen:
        msg = (f"--battery-controls={','.join(chosen)!r} must name one or more of {', '.join(NEGATIVE_CONTROLS)}; "
               "leave it out to run them all")
        raise BadInput(msg)

    start = time.monotonic()
    n_steps = 8
    report = Report(config_path, outputs)
    r = report.results

    def step(k: int, title: str) -> None:
        progress(f"[report {k}/{n_steps}] {title} ({time.monotonic() - start:.0f} s elapsed)")

    # Refuse another data lock before anything runs, so a bad --outputs costs nothing and changes nothing.
    check_lock(outputs, data_lock(make_corpus(config), config), config_path)
    for w in scaling_worlds:
        make_plan(make_corpus(config), config, world_size=w, steps=1)

    step(1, "prepare: corpus, plan, data lock")
    prepared = prepare(config, outputs, config_path)
    r["prepare"] = {"data_lock": prepared.lock, "rows": len(prepared.rows), "windows": len(prepared.plan)}

    step(2, "reference: single-device gradient of the plan's first window")
    r["reference"] = compute_reference(config, outputs, prepared)
    reference = load_reference(outputs)

    step(3, f"gradient parity on {config.world_size} ranks: correct normalization and mean of means")
    window = parity_window(config, prepared)
    r["parity"] = {}
    for recipe in (CORRECT_RECIPE, MEAN_OF_MEANS):
        ((c, _),) = ddp_parity(config, recipe, [window], [reference["gradient"]])
        r["parity"][recipe.split(":")[-1]] = {**c.to_dict(), "rank_tokens": token_counts(window)}
    good, bad = r["parity"]["global_token_mean"], r["parity"]["mean_of_local_means"]
    report.checks.append(Check("parity of the correct normalization", good["passed"],
                               f"max abs error {good['max_abs_error']:.3e} over {good['components']} components"))
    report.checks.append(Check("mean-of-means control rejected", not bad["passed"],
                               f"max abs error {bad['max_abs_error']:.3e}, {bad['over_tolerance']} over tolerance"))

    step(4, "battery: the correct recipe on every case at W=2, every negative control on its target")
    progress(f"  battery: {CORRECT_RECIPE.split(':')[-1]}")
    verdicts = run_cases(CORRECT_RECIPE, plan.cases([2]))
    progress(f"  battery: {len(chosen)} negative control(s)")
    controls_run = run_controls(chosen, [2])
    r["battery"] = {"table": format_table(verdicts) + "\n\n" + format_controls(controls_run),
                    "verdicts": [v.to_dict() for v in verdicts], "controls": [c.to_dict() for c in controls_run]}
    correct_failed = [f"{v.check} ({v.scenario}, {v.precision})" for v in verdicts if not v.passed]
    unrejected = [c.control for c in controls_run if not c.rejected]
    report.checks.append(Check("battery: correct recipe passes every check", not correct_failed,
                               "every check holds" if not correct_failed else f"failed: {correct_failed}"))
    report.checks.append(Check("battery: every negative control rejected", not unrejected,
                               "each control fails its targeted check" if not unrejected
                               else f"not rejected: {unrejected}"))

    step(5, f"stop at {config.stop_at}, continuous to {config.updates}, resume {config.stop_at} -> {config.updates}")
    runs_tmp = _temp_dir(outputs / "runs")
    try:
        trio = _trio(config, runs_tmp, progress)
        final_dir = checkpoint_to_evaluate(runs_tmp / "resumed")
        step(6, "evaluate the resumed run's last checkpoint on the test split")
        ev = evaluate(config, final_dir, prepared.lock)
    except BaseException:
        # A failed launch leaves the previous report's runs as they were, and no half-trained folder beside them.
        shutil.rmtree(runs_tmp, ignore_errors=True)
        raise
    _swap_dir(runs_tmp, outputs / "runs")
    r["resume"] = trio
    report.checks.append(Check("resume equals continuous at the last step",
                               trio["max_abs_difference_all"] == 0.0 and trio["stopped_checkpoint_complete"],
                               f"max abs difference {trio['max_abs_difference_all']!r}"))

    ev["checkpoint"] = str(outputs / "runs" / "resumed" / final_dir.name)
    r["evaluate"] = ev
    report.checks.append(Check("evaluation on the test split", ev["test_tokens"] > 0 and math.isfinite(ev["test_loss"]),
                               f"test loss {ev['test_loss']:.5f} over {ev['test_tokens']} tokens"))

    step(7, f"scaling: {scaling_steps} steps at {list(scaling_worlds)} ranks (CPU)")
    r["scaling"] = {"rows": scaling(config, scaling_worlds, scaling_steps, progress), "device": _cpu_label()}

    step(8, "writing report.md, report.json, report.png")
    r["tokens_per_window"] = plan_token_counts(prepared)
    r["checks"] = [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in report.checks]
    r["passed"] = report.passed
    r["seconds"] = time.monotonic() - start
    r["config"] = {"path": config_path, **config.to_dict()}
    write_report(report)
    progress(f"[report] done in {time.monotonic() - start:.0f} s")
    return report


def _cpu_label() -> str:
    import platform

    return f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), gloo, 1 thread per rank"


def write_report(report: Report) -> None:
    from harness.workflow.figures import write_figure

    r, out = report.results, report.outputs
    tmp_png = out / f".report.png.tmp-{os.getpid()}"
    write_figure(tmp_png, r["tokens_per_window"], r["resume"]["continuous_losses"], r["resume"]["resumed_losses"],
                 r["resume"]["stop_at"])
    os.replace(tmp_png, out / "report.png")
    write_json(out / "report.json", r)
    write_text(out / "report.md", markdown(report))


def _fmt(x: float) -> str:
    return f"{x:.3e}" if x != 0 else "0"


def markdown(report: Report) -> str:
    r = report.results
    good, bad = r["parity"]["global_token_mean"], r["parity"]["mean_of_local_means"]
    ev, trio = r["evaluate"], r["resume"]
    lines = [
        "# DDP token-mean report",
        "",
        f"Config `{r['config']['path']}`, data lock `{r['prepare']['data_lock'][:16]}...`, "
        f"{r['config']['world_size']} ranks (CPU, gloo). Every number below was computed by this run "
        f"({r['seconds']:.0f} s).",
        "",
        "## Seed 000's three questions",
        "",
        "| question | measured |",
        "| --- | --- |",
        f"| components compared | {good['components']} |",
        f"| tokens per rank in the compared window | {good['rank_tokens']} |",
        f"| max abs error, global token mean (correct) | {_fmt(good['max_abs_error'])} "
        f"({'within' if good['passed'] else 'NOT within'} atol={good['atol']:g}, rtol={good['rtol']:g}) |",
        f"| max abs error, mean of local means (control) | {_fmt(bad['max_abs_error'])} "
        f"({bad['over_tolerance']} components over tolerance) |",
        f"| resume max abs difference at step {trio['updates']} (model, optimizer, scheduler) | "
        f"{trio['max_abs_difference_all']!r} |",
        f"| test loss (per supervised token) | {ev['test_loss']:.5f} |",
        f"| token accuracy | {100 * ev['test_accuracy']:.2f}% |",
        f"| valid test tokens | {ev['test_tokens']} ({ev['test_sequences']} sequences) |",
        "",
        "## Checks",
        "",
        "| check | verdict | detail |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {c.name} | {'PASS' if c.passed else 'FAIL'} | {c.detail} |" for c in report.checks]
    lines += [
        "",
        "## Gradient parity (the plan's first window)",
        "",
        "| normalization | max abs error | worst ratio | over tolerance |",
        "| --- | --- | --- | --- |",
        f"| global token mean | {_fmt(good['max_abs_error'])} | {good['worst_ratio']:.3g} | {good['over_tolerance']} |",
        f"| mean of local means | {_fmt(bad['max_abs_error'])} | {bad['worst_ratio']:.3g} | {bad['over_tolerance']} |",
        "",
        "## Battery (W=2; PASS/FAIL with the max error where there is one)",
        "",
        "```",
        r["battery"]["table"],
        "```",
        "",
        "## Resume",
        "",
        f"Stopped at step {trio['stopped_final_step']}, resumed from step {trio['resumed_start_step']} to "
        f"{trio['updates']}; max abs difference from the continuous run: "
        + ", ".join(f"{k} {v!r}" for k, v in trio["max_abs_difference"].items())
        + f"; loss histories equal: {trio['losses_equal']}.",
        "",
        "## Scaling (CPU figures on this machine, not a GPU prediction)",
        "",
        f"{r['scaling']['device']}. The same training workload (correct recipe, SGD) at each world size; "
        "efficiency = throughput_W / (W * throughput_1) (seed 003).",
        "",
        "| ranks | steps | tokens | seconds | tokens/s | efficiency |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in r["scaling"]["rows"]:
        eff = "n/a" if s["efficiency"] is None else f"{s['efficiency']:.2f}"
        lines.append(f"| {s['world_size']} | {s['steps']} | {s['tokens']} | {s['seconds']:.2f} | "
                     f"{s['tokens_per_s']:.0f} | {eff} |")
    lines += ["", "![tokens per rank per window, and loss curves](report.png)", ""]
    return "\n".join(lines)


def summary_table(report: Report) -> str:
    """The short table the command prints at the end (the three questions' numbers)."""
    r = report.results
    good, bad = r["parity"]["global_token_mean"], r["parity"]["mean_of_local_means"]
    ev, trio = r["evaluate"], r["resume"]
    rows = [
        ("components compared", str(good["components"])),
        ("max abs error, global token mean", _fmt(good["max_abs_error"])),
        ("max abs error, mean of means", _fmt(bad["max_abs_error"])),
        (f"resume max abs difference at {trio['updates']}", repr(trio["max_abs_difference_all"])),
        ("test loss", f"{ev['test_loss']:.5f}"),
        ("token accuracy", f"{100 * ev['test_accuracy']:.2f}%"),
        ("valid test tokens", str(ev["test_tokens"])),
    ]
    for s in r["scaling"]["rows"]:
        eff = "" if s["efficiency"] is None else f", efficiency {s['efficiency']:.2f}"
        rows.append((f"CPU throughput at {s['world_size']} rank(s)", f"{s['tokens_per_s']:.0f} tokens/s{eff}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("")
    lines += [f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in report.checks]
    return "\n".join(lines)


__all__ = [
    "BadInput",
    "Report",
    "check_lock",
    "checkpoint_problems",
    "checkpoint_to_evaluate",
    "compute_reference",
    "evaluate",
    "evaluate_checkpoint",
    "prepare",
    "require_prepared",
    "run_exercise",
    "run_report",
    "scaling",
    "timed_training",
    "window_gradients",
]
