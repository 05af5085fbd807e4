"""Command line: ``python -m harness <command>`` (or the ``ddp-harness`` console script).

Seed 000's workflow: prepare, reference, check-loss, evaluate, exercise, check-environment, check-checkpoints, clean,
and ``report``, which runs the whole protocol and writes report.md, report.json and report.png; plus ``battery``.

Exit codes: 0 when every check a command ran holds; 1 when a check fails (the last line names it); 2 for input that
cannot be used as given (a missing or invalid config, an outputs folder from another data lock, an incomplete
checkpoint), in which case nothing was written and existing outputs are untouched.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from harness.core.loss import global_token_loss
from harness.data.config import Config, load_config
from harness.recipes import CORRECT_RECIPE
from harness.workflow.report import BadInput


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_check_loss(args: argparse.Namespace) -> int:
    """Seed 000's counterexample: 12 and 36 tokens with loss sums 12 and 108."""
    if getattr(args, "config", None) is not None:
        _config(args)  # the seed passes --config; the numbers are fixed, but a broken config is still reported
    sums, counts, world = [12.0, 108.0], [12, 36], 2
    mean_of_means = sum(s / n for s, n in zip(sums, counts)) / world
    scaled = [float(global_token_loss(torch.tensor(s), sum(counts), world)) for s in sums]
    global_mean = sum(scaled) / world
    print(f"local tokens {counts}, local loss sums {sums}")
    print(f"mean of local means: {mean_of_means}")
    print(f"global token mean:   {global_mean} (scaled local losses {scaled}, averaged over {world} ranks)")
    if (mean_of_means, global_mean) != (2.0, 2.5):
        _err(f"FAILED: check-loss expected 2.0 and 2.5, got {mean_of_means} and {global_mean}")
        return 1
    return 0


def cmd_battery(args: argparse.Namespace) -> int:
    """Judge recipes under test on the battery's cases, and the negative controls on their targets.

    ``--recipe X`` (repeatable) judges X as a recipe under test: exit 0 when every check holds, 1 when one fails.
    ``--controls`` (every control, or the named ones) runs the controls: each must be rejected by its targeted check
    failing on its own mistake. With neither, the correct recipe and every control run. 2 is bad input.
    """
    import time

    from harness.battery import plan
    from harness.battery.table import format_controls, format_table, report_json, run_cases, run_controls
    from harness.recipes import CONTROLS, RecipeError, load_recipe

    try:
        worlds = plan.parse_world_sizes(args.world_sizes)
        cases = plan.cases(worlds, args.precision)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if args.controls is None:
        controls: list[str] = [] if args.recipe else list(CONTROLS)
    else:
        controls = [c for c in args.controls.split(",") if c] or list(CONTROLS)
    unknown = [c for c in controls if c not in CONTROLS]
    if unknown:
        raise BadInput(f"--controls={args.controls!r}: {', '.join(unknown)} not among {', '.join(CONTROLS)}")
    recipes = list(args.recipe or ([] if args.controls is not None else [CORRECT_RECIPE]))
    for r in recipes:
        try:
            load_recipe(r)
        except RecipeError as exc:
            raise BadInput(f"--recipe: {exc}") from None
    progress = (lambda s: _err(f"  running {s}")) if args.verbose else None
    start = time.monotonic()
    if args.examples < 0:
        raise BadInput(f"--examples={args.examples} must be 0 (no drawn layouts) or a positive number")
    drawn = args.examples > 0 and importlib.util.find_spec("hypothesis") is not None
    verdicts = []
    for r in recipes:
        verdicts += run_cases(r, cases, args.deadline, progress)
        if drawn:
            from harness.battery.layouts import drawn_verdict

            if progress:
                progress(f"{r.split(':')[-1]}: {args.examples} drawn layouts")
            verdicts.append(drawn_verdict(r, args.examples, derandomize=os.environ.get("CI", "") == "true"))
    results = run_controls(controls, worlds, args.deadline, progress) if controls else []
    if verdicts:
        print(format_table(verdicts))
    if results:
        print(("\n" if verdicts else "") + "negative controls, each on its target:\n" + format_controls(results))
    failed = [v for v in verdicts if not v.passed]
    unrejected = [c for c in results if not c.rejected]
    status = 1 if failed or unrejected else 0
    print(f"\n{len(verdicts)} checks over {len(recipes)} recipe(s) and {len(results)} control targets at world sizes "
          f"{list(worlds)}, precision {args.precision}, in {time.monotonic() - start:.1f} s (CPU, gloo)")
    for path in filter(None, (args.json, args.battery_report)):
        from harness.workflow.report import write_json

        expected = (len(cases) + drawn) * len(recipes)
        write_json(Path(path), report_json(recipes, verdicts, expected, status, controls=results, world_sizes=worlds,
                                           precision=args.precision))
        print(f"report written to {path}")
    for v in failed:
        _err(v.message)
    for c in unrejected:
        _err(f"control {c.control} not rejected: {c.verdict.message}")
    if failed:
        first = failed[0]
        _err(f"FAILED: {len(failed)} check(s) failed; first: {first.check} of {first.recipe} ({first.scenario}, "
             f"W={first.world_size}, {first.precision})")
    elif unrejected:
        _err(f"FAILED: negative control(s) not rejected by their targeted check: "
             f"{sorted({c.control for c in unrejected})}")
    else:
        print("every check holds" + ("; every negative control is rejected by its targeted check" if results else ""))
    return status


# ------------------------------------------------------------------------------------------------ shared plumbing

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/minimum.yaml"


def _config_path(args: argparse.Namespace) -> str:
    if args.config is not None:
        return str(args.config)
    # From the checkout's root the relative path is the one to print; elsewhere fall back to the checkout's copy.
    if Path(DEFAULT_CONFIG).is_file() or not (ROOT / DEFAULT_CONFIG).is_file():
        return DEFAULT_CONFIG
    return str(ROOT / DEFAULT_CONFIG)


def _config(args: argparse.Namespace) -> Config:
    path = _config_path(args)
    try:
        return load_config(path)
    except ValueError as exc:
        raise BadInput(f"--config: {exc}") from None


def _outputs(args: argparse.Namespace) -> Path:
    return Path(args.outputs)


def _progress(message: str) -> None:
    _err(message)


# ------------------------------------------------------------------------------------------------------ commands


def cmd_prepare(args: argparse.Namespace) -> int:
    """Corpus, plan and data lock under the outputs folder."""
    from harness.workflow.report import prepare

    config = _config(args)
    out = _outputs(args)
    prepared = prepare(config, out, _config_path(args))
    counts = [sum(prepared.rows[i].supervised for mb in rank for i in mb) for rank in prepared.plan[0]]
    print(f"corpus: {len(prepared.rows)} rows ({config.train_size} train, {config.val_size} val, "
          f"{config.test_size} test) -> {out / 'data' / 'corpus.jsonl'}")
    print(f"plan: {len(prepared.plan)} windows x {config.world_size} ranks x {config.accumulation} microbatches "
          f"-> {out / 'data' / 'plan.json'}; first window's supervised tokens per rank: {counts}")
    print(f"data lock: {prepared.lock} -> {out / 'outputs.json'}")
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    """The single-device gradient of the plan's first window, from the initial weights."""
    from harness.workflow.report import compute_reference, require_prepared

    config = _config(args)
    out = _outputs(args)
    prepared = require_prepared(config, out, _config_path(args))
    s = compute_reference(config, out, prepared)
    print(f"reference: window 0, tokens per rank {s['rank_tokens']} (total {s['tokens']}), global token mean loss "
          f"{s['loss']:.6f}, {s['components']} gradient components, norm {s['gradient_norm']:.6e}")
    print(f"saved to {out / 'reference' / 'reference.pt'} and reference.json")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Test loss, token accuracy and valid tokens of a run directory's newest checkpoint."""
    from harness.data.corpus import data_lock, make_corpus
    from harness.workflow.report import checkpoint_to_evaluate, evaluate, read_manifest

    config = _config(args)
    if args.checkpoint:
        step_dir = Path(args.checkpoint)
        try:
            read_manifest(step_dir)
        except ValueError as exc:
            raise BadInput(f"--checkpoint: {exc}") from None
    else:
        run_dir = Path(args.run_dir) if args.run_dir else _outputs(args) / "runs" / "resumed"
        step_dir = checkpoint_to_evaluate(run_dir)
    _err(f"evaluating {step_dir} on {config.world_size} rank(s)")
    ev = evaluate(config, step_dir, data_lock(make_corpus(config), config))
    print(f"checkpoint {ev['checkpoint']} (step {ev['step']}), {ev['world_size']} ranks, sums all-reduced:")
    print(f"test loss       {ev['test_loss']:.5f} per supervised token")
    print(f"token accuracy  {100 * ev['test_accuracy']:.2f}%")
    print(f"valid tokens    {ev['test_tokens']} over {ev['test_sequences']} test sequences")
    return 0


def cmd_exercise(args: argparse.Namespace) -> int:
    """Seed 000's exercise on real ranks: rank 1 goes from 12 to 36 supervised tokens."""
    from harness.workflow.report import run_exercise

    config = _config(args)
    result = run_exercise(config, progress=_progress)
    print("The seed's arithmetic (1 per token on rank 0, 3 per token on rank 1):")
    for s in result["seed_arithmetic"]:
        print(f"  tokens {s['tokens']}: mean of means {s['mean_of_means']:g}, global token mean {s['global_mean']:g}")
    print("Measured on the model of the config (initial weights, the same rows; rank 1's grow longer):")
    for m in result["measured"]:
        means = ", ".join(f"{x:.4f}" for x in m["local_means"])
        print(f"  tokens {m['tokens']}: local means [{means}], mean of means {m['mean_of_means']:.6f}, global token "
              f"mean {m['global_mean']:.6f}; rank 0's weight: {m['short_rank_weight_mean_of_means']:.2f} in the mean "
              f"of means, {m['short_rank_weight_global']:.2f} in the token mean")
    print(f"Gradients produced on 2 ranks vs the single-device reference ({result['components']} components):")
    for name, g in result["gradients"].items():
        for row in g["layouts"]:
            verdict = "matches" if row["matches_reference"] else f"MISSES ({row['over_tolerance']} over tolerance)"
            print(f"  {name:<20} tokens {row['tokens']}: norm {row['gradient_norm']:.6e}, max abs error "
                  f"{row['max_abs_error']:.3e}, {verdict}")
        print(f"  {name:<20} gradient moved by up to {g['moved_max_abs']:.3e} between the layouts")
    if not result["passed"]:
        _err("FAILED: exercise: expected both normalizations to match at 12/12 and only the global token mean at "
             "12/36")
        return 1
    print("W stays 2, N goes from 24 to 48: the global token mean follows; the mean of means keeps rank 0 at half "
          "the weight and misses the reference")
    return 0


def cmd_check_environment(args: argparse.Namespace) -> int:
    """Python, torch, backends and devices; ``--dual``: two ranks meet through the launcher."""
    import platform

    import torch.distributed as dist

    from harness.testing.skips import two_gpus_missing

    config = _config(args)
    available = dist.is_available()
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"python      {platform.python_version()} ({sys.executable})")
    print(f"torch       {torch.__version__}")
    print(f"distributed {'available' if available else 'NOT available'}; gloo "
          f"{'yes' if available and dist.is_gloo_available() else 'no'}, nccl "
          f"{'yes' if available and dist.is_nccl_available() else 'no'}")
    print(f"cpu         {platform.machine()}, {os.cpu_count()} cores")
    names = [torch.cuda.get_device_name(i) for i in range(cuda)]
    print(f"cuda        {cuda} device(s){': ' + ', '.join(names) if names else ''}")
    print(f"config      {_config_path(args)}: world_size {config.world_size}")
    if not (available and dist.is_gloo_available()):
        _err("FAILED: check-environment: torch.distributed with gloo is needed for the CPU lanes")
        return 1
    if not args.dual:
        return 0
    from harness.dist.launcher import LaunchError, launch
    from harness.dist.probes import all_reduce_rank

    start = time.monotonic()
    try:
        sums = launch(all_reduce_rank, 2, deadline=args.deadline)
    except LaunchError as exc:
        _err(str(exc))
        _err("FAILED: check-environment --dual: two gloo ranks could not meet")
        return 1
    if sums != [3, 3]:
        _err(f"FAILED: check-environment --dual: all_reduce of 1 + 2 gave {sums}, expected [3, 3]")
        return 1
    print(f"dual        two gloo ranks met and all-reduced 1 + 2 = 3 in {time.monotonic() - start:.2f} s")
    why = two_gpus_missing()
    print(f"gpu2 lane   {'cannot run here: ' + why if why else 'can run here (2 CUDA devices, NCCL)'}")
    return 0


def cmd_check_checkpoints(args: argparse.Namespace) -> int:
    """Every step directory's manifest under the run directories."""
    from harness.workflow.report import checkpoint_problems, step_dirs

    if args.run_dir:
        run_dirs = [Path(d) for d in args.run_dir]
    else:
        runs = _outputs(args) / "runs"
        found = runs.iterdir() if runs.is_dir() else iter(())
        run_dirs = sorted(p for p in found if p.is_dir() and not p.name.startswith("."))
    if not run_dirs:
        raise BadInput(f"no run directory under {_outputs(args) / 'runs'}; pass --run-dir DIR (repeatable)")
    for d in run_dirs:
        if not d.is_dir():
            raise BadInput(f"--run-dir {str(d)!r} is not a directory")
    bad: list[tuple[Path, str]] = []
    total = 0
    for d in run_dirs:
        folders = step_dirs(d)
        problems = dict(checkpoint_problems(d))
        total += len(folders)
        for folder in folders:
            print(f"{'INVALID' if folder in problems else 'ok':<8} {folder}")
        bad += list(problems.items())
    print(f"{total} step directories in {len(run_dirs)} run director{'y' if len(run_dirs) == 1 else 'ies'}, "
          f"{len(bad)} invalid")
    for folder, why in bad:
        _err(f"{folder}: {why}")
    if bad:
        _err(f"FAILED: check-checkpoints: {len(bad)} invalid step director{'y' if len(bad) == 1 else 'ies'}, first "
             f"{bad[0][0]}")
        return 1
    return 0


GENERATED = ("data", "reference", "runs", "report.md", "report.json", "report.png", "outputs.json")
"""What the harness writes into an outputs folder; clean removes these names and its own temporary names only."""
TRAIN_RUNS = ("stopped", "continuous", "resumed")
"""harness.train's default run folders under ``runs/``."""


def cmd_clean(args: argparse.Namespace) -> int:
    """Generated files: listed by default, deleted with --yes; nothing outside the outputs and run folders."""
    out = _outputs(args)
    targets: list[Path] = []
    if (out / "outputs.json").is_file():
        targets += [out / n for n in GENERATED if (out / n).exists()]
        targets += [p for p in out.iterdir() if p.name.startswith((".tmp-", ".old-", ".report.")) or ".tmp-" in p.name]
    elif out.exists():
        # Without the marker this folder was not made by prepare: its contents may be the user's, so leave them.
        _err(f"{out}: no outputs.json, so not an outputs folder made by `prepare`; leaving it alone")
    runs = Path(args.runs)
    targets += [runs / n for n in TRAIN_RUNS if (runs / n).is_dir()]
    targets = sorted(set(targets))
    if not targets:
        print("nothing to clean")
        return 0
    for t in targets:
        print(f"{'deleting' if args.yes else 'would delete'} {t}{'/' if t.is_dir() else ''}")
    if not args.yes:
        print(f"dry run: {len(targets)} item(s) listed, nothing deleted; add --yes to delete them")
        return 0
    for t in targets:
        if t.is_dir() and not t.is_symlink():
            shutil.rmtree(t)
        else:
            t.unlink()
    print(f"deleted {len(targets)} item(s)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """The whole protocol and its report."""
    from harness.workflow.report import run_report, summary_table

    config = _config(args)
    if args.scaling_steps < 1:
        raise BadInput(f"--scaling-steps={args.scaling_steps} must be a positive number of steps, e.g. 20")
    out = _outputs(args)
    start = time.monotonic()
    controls = args.battery_controls.split(",") if args.battery_controls else None
    report = run_report(config, _config_path(args), out, progress=_progress, scaling_steps=args.scaling_steps,
                        controls=controls)
    print(summary_table(report))
    print(f"\nreport written to {out / 'report.md'} (with {out / 'report.json'} and {out / 'report.png'}) in "
          f"{time.monotonic() - start:.0f} s")
    failed = report.failed()
    if failed:
        _err(f"FAILED: report: {failed[0].name} ({failed[0].detail})"
             + (f" and {len(failed) - 1} more" if len(failed) > 1 else ""))
        return 1
    print(f"report: every check holds; read {out / 'report.md'}")
    return 0


def _add_config(p: argparse.ArgumentParser, outputs: bool = True, default: str | None = DEFAULT_CONFIG) -> None:
    p.add_argument("--config", default=None, metavar="YAML",
                   help=f"run configuration (default: {default})" if default else "run configuration (optional)")
    if outputs:
        p.add_argument("--outputs", default="outputs", metavar="DIR", help="outputs folder (default: outputs/)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="corpus, plan and data lock, saved under the outputs folder")
    _add_config(p)
    p.set_defaults(fn=cmd_prepare)

    p = sub.add_parser("reference", help="the single-device control gradient from the same initial state, saved")
    _add_config(p)
    p.set_defaults(fn=cmd_reference)

    p = sub.add_parser("check-loss", help="the 12/36-token counterexample: mean of means 2, token mean 2.5")
    _add_config(p, outputs=False, default=None)
    p.set_defaults(fn=cmd_check_loss)

    p = sub.add_parser("evaluate", help="test loss, token accuracy and valid tokens of a run's newest checkpoint")
    _add_config(p)
    p.add_argument("--run-dir", metavar="DIR", help="run directory (default: OUTPUTS/runs/resumed)")
    p.add_argument("--checkpoint", metavar="STEP_DIR", help="evaluate this step directory instead")
    p.set_defaults(fn=cmd_evaluate)

    p = sub.add_parser("exercise", help="seed 000's exercise on real ranks: rank 1 goes from 12 to 36 tokens")
    _add_config(p, outputs=False, default="configs/minimum.yaml; use configs/exercise.yaml")
    p.set_defaults(fn=cmd_exercise)

    p = sub.add_parser("check-environment", help="python, torch, backends, devices; --dual: two ranks meet")
    _add_config(p, outputs=False)
    p.add_argument("--dual", action="store_true", help="check that two gloo ranks can meet through the launcher")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds the two ranks may take")
    p.set_defaults(fn=cmd_check_environment)

    p = sub.add_parser("check-checkpoints", help="validate every step directory's manifest under the run dirs")
    _add_config(p)
    p.add_argument("--run-dir", action="append", metavar="DIR",
                   help="run directory to check (repeatable; default: every run under OUTPUTS/runs)")
    p.set_defaults(fn=cmd_check_checkpoints)

    p = sub.add_parser("clean", help="list (default) or delete (--yes) generated files")
    _add_config(p)
    p.add_argument("--scope", choices=("generated",), required=True, help="what to clean: generated files only")
    p.add_argument("--runs", default="runs", metavar="DIR",
                   help="harness.train's run folder (default: runs/; only its stopped/continuous/resumed)")
    p.add_argument("--yes", action="store_true", help="delete; without it, only list what would go")
    p.set_defaults(fn=cmd_clean)

    p = sub.add_parser("report", help="the whole protocol; writes report.md, report.json and report.png")
    _add_config(p)
    p.add_argument("--scaling-steps", type=int, default=20, help="timed steps per world size in the scaling table")
    p.add_argument("--battery-controls", metavar="NAME,...",
                   help="negative controls the battery runs (default: every one; e.g. mean_of_local_means)")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("battery", help="judge recipes on every check; run the negative controls on their targets")
    p.add_argument("--recipe", action="append", metavar="PKG.MODULE:ATTR",
                   help="a recipe under test (repeatable); default: the correct recipe, with every control")
    p.add_argument("--controls", nargs="?", const="", metavar="NAME,...",
                   help="run the negative controls (all, or the named ones); the default when no --recipe is given")
    p.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated world sizes (default: 1,2,3,4)")
    p.add_argument("--precision", default="both", choices=("fp32", "fp64", "both"),
                   help="float32 lane, float64 lane or both (default: both)")
    p.add_argument("--deadline", type=float, default=30.0, help="seconds one run may take before it is called hung")
    p.add_argument("--examples", type=int, default=12, help="drawn layouts per recipe (0: none; needs hypothesis)")
    p.add_argument("--json", metavar="PATH", help="write the battery report (expected and run counts, verdicts, "
                   "errors, exit status) as JSON")
    p.add_argument("--battery-report", metavar="PATH", help="the same report, under pytest's option name")
    p.add_argument("-v", "--verbose", action="store_true", help="print each run as it starts")
    p.set_defaults(fn=cmd_battery)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from harness.dist.launcher import LaunchError

    try:
        return int(args.fn(args))
    except BadInput as exc:
        _err(f"error: {exc}")
        return 2
    except LaunchError as exc:
        _err(str(exc))
        _err(f"FAILED: {args.command}: a launched run failed: {str(exc).splitlines()[0]}")
        return 1
