"""The commands that check or tidy rather than produce: battery, check-environment, check-checkpoints and clean."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from harness.battery.plan.options import BatteryOptions
from harness.battery.prepare.objective import AuxiliaryError
from harness.core.router_terms import DeclarationError
from harness.model import ModelError
from harness.recipes import CORRECT_RECIPE
from harness.workflow.commands import config_from, config_path_of, outputs_of
from harness.workflow.outputs import BadInput, err, leftover_in_use


def check_model_option(model: str | None, batch_format: str = "harness") -> str | None:
    """``--model`` built once in this process and run on one microbatch before any rank starts: a bad path, factory
    or output is bad input (exit 2)."""
    model_notes(model, batch_format)
    return model


def model_notes(model: str | None, batch_format: str = "harness") -> tuple[str, ...]:
    """What the probe of ``--model`` found (:class:`harness.battery.prepare.probe.facts.ModelFacts`), as sentences;
    BadInput when the model cannot be used at all, or its backward is not the gradient of its forward. The built-in
    model (None) is probed too (its backward is checked before every battery) and has nothing to say."""
    from harness.battery.prepare.probe.facts import probe

    try:
        found = probe(model, batch_format).notes()
    except ModelError as exc:
        raise BadInput(f"--model: {exc}" if model is not None else str(exc)) from None
    return found if model is not None else ()


def battery_options(args: argparse.Namespace) -> BatteryOptions:
    """The battery's options from the command line, parsed once (the pytest plugin parses its own options through the
    same :meth:`~harness.battery.plan.options.BatteryOptions.parse`); bad input names the option."""
    from harness.battery.plan.skips import check_skips

    try:
        options = BatteryOptions.parse(
            model=getattr(args, "model", None), batch_format=getattr(args, "batch_format", "harness"),
            strategy=getattr(args, "strategy", "ddp"), precision=args.precision, world_sizes=args.world_sizes,
            examples=args.examples, deadline=args.deadline,
            find_unused=getattr(args, "find_unused_parameters", "auto"), report=args.json,
            objective=getattr(args, "objective", "token_mean"), mesh=getattr(args, "mesh", None),
            chunking=getattr(args, "cp_chunking", "contiguous"), pp_schedule=getattr(args, "pp_schedule", "gpipe"),
            pp_steps=getattr(args, "pp_steps", 1), pp_microbatches=getattr(args, "pp_microbatches", 2),
            skip=getattr(args, "skip", None), quick=getattr(args, "quick", False))
        check_skips(options.skip)  # the registry's names: an unknown one is bad input before any run
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return options


def where_run(worlds: Sequence[int], meshes: Sequence[Any], verdicts: Sequence[Any]) -> str:
    """Where the cases ran, for the summary line: the world sizes of the ``dp=W`` cases that ran (all of ``worlds``
    when none ran and no mesh was given), and each mesh with its world size."""
    flat = sorted({v.world_size for v in verdicts if v.mesh is None and v.world_size > 0})
    parts = [f"at world sizes {flat or list(worlds)}"] if flat or not meshes else []
    if meshes:
        over = " and ".join(f"{m.label} (W={m.world_size})" for m in meshes)
        parts.append(f"{'the cases ' if parts else ''}over mesh {over}")
    return ", ".join(parts)


def ran_at(worlds: Sequence[int], meshes: Sequence[Any], verdicts: Sequence[Any]) -> list[int]:
    """The world sizes the cases ran at (the report's ``world_sizes``): the ``dp=W`` cases' and the meshes'; ``worlds``
    where no case ran."""
    found = {v.world_size for v in verdicts if v.world_size > 0} | {m.world_size for m in meshes}
    return sorted(found) if verdicts else list(worlds)


def cmd_battery(args: argparse.Namespace) -> int:
    """Judge recipes under test on the battery's cases, and the negative controls on their targets.

    ``--recipe X`` (repeatable) judges X as a recipe under test: exit 0 when every check holds, 1 when one fails.
    ``--battery-controls`` (every control, or the named ones) runs the controls: each must be rejected by its targeted
    check failing on its own mistake. With neither, the correct recipe and every control run. 2 is bad input.
    """
    from harness.battery.plan import cases as plan
    from harness.battery.plan.skips import skip_all
    from harness.battery.report.summary import compact_table, format_summary, write_full_report
    from harness.battery.report.table import format_controls, format_table, report_json, run_cases, run_controls
    from harness.recipes import CONTROLS, RecipeError, load_recipe

    options = battery_options(args)
    if any(m.size("tp") > 1 or m.size("pp") > 1 for m in options.meshes):
        from harness.battery.prepare.probe.facts import probe_meshes

        try:  # a model without a tp plan or a pp split it can run is refused once, before any case
            probe_meshes(options.model, options.meshes, options.batch_format, options.pp_schedule)
        except ModelError as exc:
            raise BadInput(f"--model: {exc}" if options.model is not None else str(exc)) from None
    cases = plan.session_cases(options)
    worlds, model, batch_format = options.world_sizes, options.model, options.batch_format
    if args.controls is None:
        controls: list[str] = [] if args.recipe else list(CONTROLS)
    else:
        controls = [c for c in args.controls.split(",") if c] or list(CONTROLS)
    unknown = [c for c in controls if c not in CONTROLS]
    if unknown:
        raise BadInput(f"--battery-controls={args.controls!r}: {', '.join(unknown)} not among {', '.join(CONTROLS)}")
    recipes = list(args.recipe or ([] if args.controls is not None else [CORRECT_RECIPE]))
    for r in recipes:
        try:
            load_recipe(r)
        except RecipeError as exc:
            raise BadInput(f"--recipe: {exc}") from None
    from harness.battery.judge import crash_report
    from harness.battery.launch import preflight, printed

    # What the ranks print, and what the model's constructor prints while the probe and the reference build it here:
    # once per distinct line, at the end (-v: as it comes).
    said = printed.start(args.verbose)
    try:
        # The model's probe runs in the first pre-flight's preparation (the same stay as the case's reference);
        # with --battery-keep-going there is no pre-flight, and it runs here. Either way before any rank starts.
        found = model_notes(model, batch_format) if args.keep_going or not recipes else None
    except BadInput:
        printed.stop(said)
        raise
    progress = (lambda s: err(f"  running {s}")) if args.verbose else None
    start = time.monotonic()
    drawn = options.examples > 0 and importlib.util.find_spec("hypothesis") is not None
    from harness.battery.plan.cases import drawn_lanes

    lanes = drawn_lanes(options) if drawn else []  # one drawn row per precision lane and strategy
    for r in recipes if not args.keep_going else []:
        try:
            stopped = preflight.preflight(r, cases, options, probe=True)
        except ModelError as exc:
            printed.stop(said)
            raise BadInput(f"--model: {exc}" if model is not None else str(exc)) from None
        except (AuxiliaryError, DeclarationError) as exc:  # the recipe's auxiliary term, refused before any rank
            printed.stop(said)
            raise BadInput(f"--recipe: {exc}") from None
        if stopped:
            block = printed.stop(said)
            if block:
                print(block, flush=True)
            err(stopped)
            return 1
    if found is None:
        found = model_notes(model, batch_format)  # the probe's findings, as the pre-flight's preparation found them
    verdicts = []
    for r in recipes:
        verdicts += run_cases(r, cases, options, progress)
        for lane in lanes:
            from harness.battery.layouts import drawn_verdict

            if progress:
                mesh = "" if lane.mesh is None else f", mesh {lane.mesh.label}"
                where = f"{lane.precision}, {lane.strategy}{mesh}"
                progress(f"{r.split(':')[-1]}: {lane.examples} drawn layouts ({where})")
            verdicts.append(drawn_verdict(r, options, derandomize=os.environ.get("CI", "") == "true",
                                          precision=lane.precision, strategy=lane.strategy, examples=lane.examples,
                                          mesh=lane.mesh))
    results = run_controls(controls, options, progress) if controls else []
    verdicts = skip_all(verdicts, options.skip)  # recorded as skipped, never dropped: the summary says what they said
    elsewhere = [c for c in controls if CONTROLS[c].launch != "in-process"]
    if elsewhere:
        print(f"not run here (they need ranks on more than one node; run them under torchrun across nodes, "
              f"python -m harness.battery.dist): {', '.join(elsewhere)}")
    if verdicts:
        print(format_table(verdicts) if args.verbose else compact_table(verdicts))
    if results:
        head = "negative controls, each on its target, and what the diagnosis reads in their gradients:"
        print(("\n" if verdicts else "") + head + "\n" + format_controls(results))
    notes = list(dict.fromkeys([*found, *(n for v in verdicts for n in v.notes if n.startswith("the model"))]))
    if notes:
        print(f"\nabout the model {model}:\n" + "\n".join(f"  {n}" for n in notes))
    failed = [v for v in verdicts if not v.passed]
    unrejected = [c for c in results if not c.rejected]
    usage = [v for v in failed if v.cause == "usage"]
    status = 2 if usage else 1 if failed or unrejected else 0
    quick = " (--quick)" if options.quick else ""
    print(f"\n{len(verdicts)} checks over {len(recipes)} recipe(s) and {len(results)} control targets "
          f"{where_run(worlds, options.meshes, verdicts)}, precision {options.precision}{quick}, in "
          f"{time.monotonic() - start:.1f} s (CPU, gloo)")
    expected = (len(cases) + len(lanes)) * len(recipes)
    payload = report_json(recipes, verdicts, expected, status, controls=results,
                          world_sizes=ran_at(worlds, options.meshes, verdicts), precision=options.precision,
                          model=model, batch_format=batch_format, model_notes=notes)
    unrejected_lines = [f"control {c.control} not rejected: {c.verdict.message}" for c in unrejected]
    report, text = write_full_report(options.report, payload, verdicts, [format_controls(results), *unrejected_lines])
    junit = getattr(args, "junit", None)
    if junit:
        from harness.battery.report.junit import write_junit

        write_junit(junit, verdicts, results, duration_s=time.monotonic() - start)
        print(f"junit written to {junit}")
    if args.verbose:
        sys.stdout.flush()
        for v in failed:
            err(v.message)
    for block in (printed.stop(said), "\n".join(crash_report.grouped(verdicts))):
        if block:
            print("\n" + block)
    print("\n" + format_summary(verdicts, report, text), flush=True)  # the last screen: each cause once, its fix
    for line in unrejected_lines:
        err(line)
    if usage:
        err(f"usage error: {usage[0].message.split('usage error on ', 1)[-1]}")
    elif failed:
        first = failed[0]
        err(f"FAILED: {len(failed)} check(s) failed; first: {first.check} of {first.recipe} ({first.scenario}, "
             f"W={first.world_size}{f' {first.mesh}' if first.mesh else ''}, {first.precision})")
    elif unrejected:
        err(f"FAILED: negative control(s) not rejected by their targeted check: "
             f"{sorted({c.control for c in unrejected})}")
    else:
        skipped = sorted({v.check for v in verdicts if v.status == "skipped"})
        # A lane whose every case is n/a judged nothing: the model refused it (notes above say why).
        unjudged = sorted({v.precision for v in verdicts} - {v.precision for v in verdicts if v.status != "n/a"})
        print("every check holds" + ("; every negative control is rejected by its targeted check" if results else "")
              + (f" (skipped: {', '.join(skipped)}; see above what they said)" if skipped else "")
              + (f" (not judged: the {', '.join(unjudged)} lane{'s' if len(unjudged) > 1 else ''}, every case n/a on "
                 "this model; see above why)" if unjudged else ""))
    return status


def cmd_check_environment(args: argparse.Namespace) -> int:
    """Python, torch, backends and devices; ``--dual``: two ranks meet through the launcher."""
    import platform

    import torch.distributed as dist

    from harness.testing.skips import two_gpus_missing

    config = config_from(args)
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
    print(f"config      {config_path_of(args)}: world_size {config.world_size}")
    if not (available and dist.is_gloo_available()):
        err("FAILED: check-environment: torch.distributed with gloo is needed for the CPU lanes")
        return 1
    if not args.dual:
        return 0
    from harness.distributed.launcher import LaunchError, launch
    from harness.distributed.probes import all_reduce_rank

    start = time.monotonic()
    try:
        sums = launch(all_reduce_rank, 2, deadline=args.deadline)
    except LaunchError as exc:
        err(str(exc))
        err("FAILED: check-environment --dual: two gloo ranks could not meet")
        return 1
    if sums != [3, 3]:
        err(f"FAILED: check-environment --dual: all_reduce of 1 + 2 gave {sums}, expected [3, 3]")
        return 1
    print(f"dual        two gloo ranks met and all-reduced 1 + 2 = 3 in {time.monotonic() - start:.2f} s")
    why = two_gpus_missing()
    print(f"gpu2 lane   {'cannot run here: ' + why if why else 'can run here (2 CUDA devices, NCCL)'}")
    return 0


def cmd_check_checkpoints(args: argparse.Namespace) -> int:
    """Every step directory's manifest under the run directories, and what a killed run left (incomplete steps,
    stale temporary files): :func:`harness.resume.checkpoint.audit_run_dir`."""
    from harness.resume.checkpoint import audit_run_dir, step_dirs

    if args.run_dir:
        run_dirs = [Path(d) for d in args.run_dir]
    else:
        runs = outputs_of(args) / "runs"
        found = runs.iterdir() if runs.is_dir() else iter(())
        run_dirs = sorted(p for p in found if p.is_dir() and not p.name.startswith("."))
    if not run_dirs:
        raise BadInput(f"no run directory under {outputs_of(args) / 'runs'}; pass --run-dir DIR (repeatable)")
    for d in run_dirs:
        if not d.is_dir():
            raise BadInput(f"--run-dir {str(d)!r} is not a directory")
    problems: list[str] = []
    total = invalid = 0
    for d in run_dirs:
        folders = list(reversed(step_dirs(d)))
        lines = audit_run_dir(d)
        total += len(folders)
        for folder in folders:
            broken = any(line.startswith(f"{folder}:") for line in lines)
            invalid += broken
            print(f"{'INVALID' if broken else 'ok':<8} {folder}")
        problems += lines
    print(f"{total} step directories in {len(run_dirs)} run director{'y' if len(run_dirs) == 1 else 'ies'}, "
          f"{invalid} invalid, {len(problems) - invalid} other problem(s)")
    for line in problems:
        err(line)
    if problems:
        other = len(problems) - invalid
        err(f"FAILED: check-checkpoints: {invalid} invalid step director{'y' if invalid == 1 else 'ies'}"
            + (f" and {other} other problem(s)" if other else "") + f", first {problems[0].split(': ')[0]}")
        return 1
    return 0


GENERATED = ("data", "reference", "runs", "report.md", "report.json", "report.png", "outputs.json")
"""What the harness writes into an outputs folder; clean removes these names and its own temporary names only."""
TRAIN_RUNS = ("stopped", "continuous", "resumed")
"""harness.train's default run folders under ``runs/``."""


def cmd_clean(args: argparse.Namespace) -> int:
    """Generated files: listed by default, deleted with --yes; nothing outside the outputs and run folders.

    A ``.old-runs-PID`` folder is kept, with the reason and what to do on stderr, while its process still runs or no
    ``runs/`` exists (it may be the only copy); exit 1 with --yes when something was kept.
    """
    out = outputs_of(args)
    targets: list[Path] = []
    if (out / "outputs.json").is_file():
        targets += [out / n for n in GENERATED if (out / n).exists()]
        targets += [p for p in out.iterdir() if p.name.startswith((".tmp-", ".old-", ".report.")) or ".tmp-" in p.name]
    elif out.exists():
        # Without the marker this folder was not made by prepare: its contents may be the user's, so leave them.
        err(f"{out}: no outputs.json, so not an outputs folder made by `prepare`; leaving it alone")
    runs = Path(args.runs)
    targets += [runs / n for n in TRAIN_RUNS if (runs / n).is_dir()]
    targets = sorted(set(targets))
    # A swap's leftover may be the only copy of the runs (a crash between its two renames): never deleted here.
    kept = {t: why for t in targets if (why := leftover_in_use(t)) is not None}
    targets = [t for t in targets if t not in kept]
    for t, why in kept.items():
        err(f"{'keeping' if args.yes else 'would keep'} {t}/: {why}")
    if not targets:
        print("nothing to clean" if not kept else f"nothing else to clean; {len(kept)} item(s) kept")
        return 1 if kept and args.yes else 0
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
    print(f"deleted {len(targets)} item(s)" + (f"; kept {len(kept)}, see above" if kept else ""))
    return 1 if kept else 0


