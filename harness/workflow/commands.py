"""The commands of seed 000's workflow that produce the outputs folder: prepare, reference, evaluate, exercise,
check-loss and report; and the plumbing every command shares (the config and the outputs folder; messages on stderr
come from :func:`harness.workflow.outputs.err`).

Each ``cmd_*`` takes the parsed arguments and returns the exit code; :class:`BadInput` becomes exit 2 in
:func:`harness.workflow.cli.main`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from harness.core.loss import global_token_loss
from harness.data.config import Config, load_config
from harness.workflow.outputs import BadInput, err

# ------------------------------------------------------------------------------------------------ shared plumbing

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "configs/minimum.yaml"


def config_path_of(args: argparse.Namespace) -> str:
    if args.config is not None:
        return str(args.config)
    # From the checkout's root the relative path is the one to print; elsewhere fall back to the checkout's copy.
    if Path(DEFAULT_CONFIG).is_file() or not (ROOT / DEFAULT_CONFIG).is_file():
        return DEFAULT_CONFIG
    return str(ROOT / DEFAULT_CONFIG)


def config_from(args: argparse.Namespace) -> Config:
    path = config_path_of(args)
    try:
        return load_config(path)
    except ValueError as exc:
        raise BadInput(f"--config: {exc}") from None


def outputs_of(args: argparse.Namespace) -> Path:
    return Path(args.outputs)


def progress(message: str) -> None:
    err(message)


# ------------------------------------------------------------------------------------------------------ commands


def cmd_check_loss(args: argparse.Namespace) -> int:
    """Seed 000's counterexample: 12 and 36 tokens with loss sums 12 and 108."""
    if getattr(args, "config", None) is not None:
        config_from(args)  # the seed passes --config; the numbers are fixed, but a broken config is still reported
    sums, counts, world = [12.0, 108.0], [12, 36], 2
    mean_of_means = sum(s / n for s, n in zip(sums, counts)) / world
    scaled = [float(global_token_loss(torch.tensor(s), sum(counts), world)) for s in sums]
    global_mean = sum(scaled) / world
    print(f"local tokens {counts}, local loss sums {sums}")
    print(f"mean of local means: {mean_of_means}")
    print(f"global token mean:   {global_mean} (scaled local losses {scaled}, averaged over {world} ranks)")
    if (mean_of_means, global_mean) != (2.0, 2.5):
        err(f"FAILED: check-loss expected 2.0 and 2.5, got {mean_of_means} and {global_mean}")
        return 1
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """Corpus, plan and data lock under the outputs folder."""
    from harness.workflow.protocol import prepare

    config = config_from(args)
    out = outputs_of(args)
    prepared = prepare(config, out, config_path_of(args))
    counts = [sum(prepared.rows[i].supervised for mb in rank for i in mb) for rank in prepared.plan[0]]
    print(f"corpus: {len(prepared.rows)} rows ({config.train_size} train, {config.val_size} val, "
          f"{config.test_size} test) -> {out / 'data' / 'corpus.jsonl'}")
    print(f"plan: {len(prepared.plan)} windows x {config.world_size} ranks x {config.accumulation} microbatches "
          f"-> {out / 'data' / 'plan.json'}; first window's supervised tokens per rank: {counts}")
    print(f"data lock: {prepared.lock} -> {out / 'outputs.json'}")
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    """The single-device gradient of the plan's first window, from the initial weights."""
    from harness.workflow.protocol import compute_reference, require_prepared

    config = config_from(args)
    out = outputs_of(args)
    prepared = require_prepared(config, out, config_path_of(args))
    s = compute_reference(config, out, prepared)
    print(f"reference: window 0, tokens per rank {s['rank_tokens']} (total {s['tokens']}), global token mean loss "
          f"{s['loss']:.6f}, {s['components']} gradient components, norm {s['gradient_norm']:.6e}")
    print(f"saved to {out / 'reference' / 'reference.pt'} and reference.json")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Test loss, token accuracy and valid tokens of a run directory's newest checkpoint."""
    from harness.data.corpus import data_lock, make_corpus
    from harness.resume.checkpoint import read_manifest
    from harness.workflow.protocol import checkpoint_to_evaluate, evaluate

    config = config_from(args)
    if args.checkpoint:
        step_dir = Path(args.checkpoint)
        try:
            read_manifest(step_dir)
        except ValueError as exc:
            raise BadInput(f"--checkpoint: {exc}") from None
    else:
        run_dir = Path(args.run_dir) if args.run_dir else outputs_of(args) / "runs" / "resumed"
        step_dir = checkpoint_to_evaluate(run_dir)
    err(f"evaluating {step_dir} on {config.world_size} rank(s)")
    ev = evaluate(config, step_dir, data_lock(make_corpus(config), config))
    print(f"checkpoint {ev['checkpoint']} (step {ev['step']}), {ev['world_size']} ranks, sums all-reduced:")
    print(f"test loss       {ev['test_loss']:.5f} per supervised token")
    print(f"token accuracy  {100 * ev['test_accuracy']:.2f}%")
    print(f"valid tokens    {ev['test_tokens']} over {ev['test_sequences']} test sequences")
    return 0


def _weight(w: float | None) -> str:
    return "any (equal local means)" if w is None else f"{w:.2f}"


def cmd_exercise(args: argparse.Namespace) -> int:
    """Seed 000's exercise on real ranks: rank 1 goes from 12 to 36 supervised tokens."""
    from harness.workflow.exercise import run_exercise

    config = config_from(args)
    result = run_exercise(config, progress=progress)
    print("The seed's arithmetic (1 per token on rank 0, 3 per token on rank 1):")
    for s in result["seed_arithmetic"]:
        print(f"  tokens {s['tokens']}: mean of means {s['mean_of_means']:g}, global token mean {s['global_mean']:g}")
    print("Measured on the model of the config (initial weights, the same rows; rank 1's grow longer):")
    for m in result["measured"]:
        means = ", ".join(f"{x:.4f}" for x in m["local_means"])
        print(f"  tokens {m['tokens']}: local means [{means}], mean of means {m['mean_of_means']:.6f}, global token "
              f"mean {m['global_mean']:.6f}; rank 0's weight, read off these numbers: "
              f"{_weight(m['short_rank_weight_mean_of_means'])} in the mean of means, "
              f"{_weight(m['short_rank_weight_global'])} in the token mean")
    print(f"Gradients produced on 2 ranks vs the single-device reference ({result['components']} components):")
    for name, g in result["gradients"].items():
        for row in g["layouts"]:
            verdict = "matches" if row["matches_reference"] else f"MISSES ({row['over_tolerance']} over tolerance)"
            print(f"  {name:<20} tokens {row['tokens']}: norm {row['gradient_norm']:.6e}, max abs error "
                  f"{row['max_abs_error']:.3e}, {verdict}")
        print(f"  {name:<20} gradient moved by up to {g['moved_max_abs']:.3e} between the layouts")
    if not result["passed"]:
        err("FAILED: exercise: expected both normalizations to match at 12/12 and only the global token mean at "
            "12/36")
        return 1
    last = result["measured"][-1]
    print(f"W stays 2, N goes from 24 to 48: the global token mean follows (rank 0's weight "
          f"{_weight(last['short_rank_weight_global'])}); the mean of means keeps rank 0 at "
          f"{_weight(last['short_rank_weight_mean_of_means'])} and misses the reference")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """The whole protocol and its report."""
    from harness.workflow import render, report

    config = config_from(args)
    if args.scaling_steps < 1:
        raise BadInput(f"--scaling-steps={args.scaling_steps} must be a positive number of steps, e.g. 20")
    out = outputs_of(args)
    start = time.monotonic()
    controls = args.battery_controls.split(",") if args.battery_controls else None
    done = report.run_report(config, config_path_of(args), out, progress=progress, scaling_steps=args.scaling_steps,
                             controls=controls, resume_trainer=getattr(args, "resume_trainer", None))
    print(render.summary_table(done))
    print(f"\nreport written to {out / 'report.md'} (with {out / 'report.json'} and {out / 'report.png'}) in "
          f"{time.monotonic() - start:.0f} s")
    failed = done.failed()
    if failed:
        err(f"FAILED: report: {failed[0].name} ({failed[0].detail})"
            + (f" and {len(failed) - 1} more" if len(failed) > 1 else ""))
        return 1
    print(f"report: every check holds; read {out / 'report.md'}")
    return 0


