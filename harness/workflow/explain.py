"""``python -m harness explain``: what a recipe's step actually optimized, read off its gradient.

One battery run of the recipe per lane (a scenario at one world size, under each strategy and precision asked for:
``--strategy``, ``--precision`` and ``--objective`` take the battery's names and values, and are validated by the
same parser, :meth:`harness.battery.plan.options.BatteryOptions.parse`), then the diagnosis of the window whose gradient
is furthest from the reference (:mod:`harness.diagnosis`, fed the run as evidence): the effective weight of every
rank's microbatch against the right one, the signature those weights match, the per-parameter table, a figure (one cell
per rank x microbatch, effective weight over expected) and the same numbers as JSON. The battery's checks run on the
same run, so a case the battery rejects (a synchronization count, a clipped norm, ranks that disagree) is never read as
right. Advice is given in the strategy's own form (FSDP2: ``set_requires_gradient_sync(False)``, never ``no_sync()``),
and a right weighting is described in the declared objective's words. Exit 0 when the weighting is right and every check
holds in every lane, 1 when not (or a run left no gradient to read), 2 for bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
import re
import time
from pathlib import Path

from harness.battery.plan.options import BATCH_FORMAT_HELP, BATCH_FORMATS, add_lane_options
from harness.core.mesh import Mesh
from harness.workflow.outputs import BadInput, write_bytes, write_json

SCHEMA = "harness.explain/1"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="the effective token weights of a recipe's gradient and the mistake they name")
    p.add_argument("--recipe", required=True, metavar="PKG.MODULE:ATTR", help="the recipe to explain")
    p.add_argument("--scenario", default=None, help="battery scenario (default: uneven; where --recipe names a "
                   "negative control, its target's, as for every option below that is not given)")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: 2, or the mesh's)")
    p.add_argument("--mesh", metavar="DIM=N,...", help="run over this mesh instead of dp=W, e.g. dp=2,cp=2 (the sizes' "
                   "product is the world size; the battery's --mesh, one shape)")
    p.add_argument("--cp-chunking", default="contiguous", metavar="contiguous|load_balanced",
                   help="how the cp ranks split the positions (the battery's --cp-chunking)")
    p.add_argument("--pp-schedule", default="gpipe", metavar="gpipe|1f1b|...",
                   help="the pipeline schedule on a mesh with pp (the battery's --pp-schedule)")
    p.add_argument("--pp-steps", default="1", metavar="A",
                   help="the schedule steps of each pipelined window (the battery's --pp-steps)")
    p.add_argument("--pp-microbatches", default="2", metavar="M",
                   help="the microbatches of each schedule step (the battery's --pp-microbatches)")
    add_lane_options(p, precision="fp32")  # the battery's --strategy, --precision, --objective
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                   help="the model the recipe trains: a zero-argument callable returning a torch.nn.Module "
                   "(default: the built-in TinyCausalLM)")
    p.add_argument("--batch-format", default=None, choices=BATCH_FORMATS, help=BATCH_FORMAT_HELP)
    p.add_argument("--window", type=int, default=None, help="window to read (default: the worst one)")
    p.add_argument("--rank", type=int, default=None, help="rank whose gradient is read (default: the worst one)")
    p.add_argument("--per-sequence", action="store_true", help="also fit one weight per sequence")
    p.add_argument("--outputs", default="outputs/explain", metavar="DIR",
                   help="where the figure and JSON go (default: outputs/explain/)")
    p.add_argument("--deadline", type=float, default=30.0, help="seconds the run may take before it is called hung")
    p.add_argument("--no-recipe-level", dest="recipe_level", action="store_false",
                   help="skip the recipe-level diagnosis (the battery's quick scenarios at this world size, read "
                   "together as the battery's last screen reads them)")
    # Not given: the control's target's (control_defaults), else these (the help above names them).
    p.set_defaults(fn=cmd_explain, strategy=None, precision=None, objective=None)


DEFAULTS = {"scenario": "uneven", "batch_format": "harness", "strategy": "ddp", "precision": "fp32",
            "objective": "token_mean"}
"""What an option not given is, where --recipe is no registered negative control (or its target leaves it open)."""


def control_defaults(args: argparse.Namespace) -> str | None:
    """Where ``--recipe`` names a negative control (``harness.recipes:<name>``), fill each option not given from the
    control's target (:class:`harness.recipes.catalog.Target`: its scenario, mesh, model, strategy, precision,
    objective, batch format, first world size), so that ``explain`` reads the mistake where it shows; then every
    option still unset takes :data:`DEFAULTS`. Returns the sentence naming what was filled (None: nothing)."""
    from harness.recipes import CONTROLS

    module, _, name = args.recipe.partition(":")
    target = CONTROLS.get(name) if module == "harness.recipes" else None
    filled = []
    if target is not None:
        values = {"scenario": target.scenario, "mesh": target.mesh, "model": target.model, "strategy": target.strategy,
                  "precision": target.precision, "objective": target.objective, "batch_format": target.batch_format}
        for dest, value in values.items():
            if getattr(args, dest) is None and value is not None and value != DEFAULTS.get(dest):
                setattr(args, dest, value)
                filled.append(f"--{dest.replace('_', '-')} {value}")
        if args.world_size is None and args.mesh is None and target.world_sizes:
            args.world_size = target.world_sizes[0]
            filled.append(f"--world-size {args.world_size}")
    for dest, value in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if not filled:
        return None
    return (f"explain: {args.recipe} is a negative control; run where its mistake shows (its target): "
            f"{' '.join(filled)} (an option given on the command line wins)")


def _stem(recipe: str, scenario: str, world: int, precision: str, strategy: str = "ddp",
          mesh: str | None = None) -> str:
    """The output files' name: the recipe's module and attribute (two modules' ``:recipe`` must not overwrite each
    other), the scenario, world size, precision, strategy (DDP's unnamed) and mesh (``dp=W``'s unnamed):
    ``explain-pkg.mod-recipe-uneven-W2-fp32``, ``...-W2-bf16-fsdp2``, ``...-W4-fp32-dp2xcp2``."""
    module, _, attr = recipe.partition(":")
    name = "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", part) for part in (module, attr) if part)
    return f"explain-{name}-{scenario}-W{world}-{precision}" + ("" if strategy == "ddp" else f"-{strategy}") + (
        "" if mesh is None else "-" + Mesh.parse(mesh).stem)


def in_strategy_form(text: str, strategy: str) -> str:
    """``text`` with each way to skip a gradient synchronization written the way ``strategy`` spells it (a sentence
    of the diagnosis says ``no_sync()``; under FSDP2 that is ``set_requires_gradient_sync(False)``), and the helper
    that does it under either strategy named once."""
    from harness.battery.rank.rank_program import SKIP_SYNC

    own = SKIP_SYNC.get(strategy)
    if own is None:
        return text
    out = text
    for other, form in SKIP_SYNC.items():
        if other == strategy:
            continue
        bare = form.split(".", 1)[1]  # no_sync() as a sentence names it, without the model
        out = out.replace(form, own).replace(bare, own.split(".", 1)[1])
    if out != text:
        out += (" (harness.recipes.sync_context(model, i, n) skips the synchronization of all but the last microbatch "
                "under either strategy)")
    return out


def right_in_objective_words(found: object, objective: str) -> str:
    """The reading of a right weighting in the declared objective's own words (the catalog's sentence speaks of the
    token mean: "every token weighs 1/N")."""
    from harness.core.objectives import DESCRIPTIONS, QUANTITIES
    from harness.diagnosis.result import Diagnosis

    assert isinstance(found, Diagnosis)
    if objective == "token_mean":
        return found.line()
    worst = max((abs(q - 1) for q in found.ratios() if math.isfinite(q)), default=0.0)
    return (f"diagnosis ({found.signature.name}): the weighting is right for {DESCRIPTIONS[objective]}: every block's "
            f"weight is 1/Z, Z = {found.z:g} ({QUANTITIES[objective]}), to within {worst:.1e}, residual "
            f"{found.residual:.1e}")


def write_weight_figure(path: Path, diagnosis: object) -> Path:
    """One cell per rank x microbatch: the fitted weight over the expected ``1/N`` (1 is right), annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from harness.diagnosis.result import Diagnosis

    assert isinstance(diagnosis, Diagnosis)
    ranks = 1 + max(b.rank for b in diagnosis.blocks)
    mbs = 1 + max(b.microbatch for b in diagnosis.blocks)
    grid = np.full((ranks, mbs), np.nan)
    for b, q in zip(diagnosis.blocks, diagnosis.ratios()):
        grid[b.rank, b.microbatch] = q
    finite = grid[np.isfinite(grid)]
    spread = max(float(np.abs(finite - 1).max()) if finite.size else 0.0, 0.05)
    fig, ax = plt.subplots(figsize=(1.4 + 1.2 * mbs, 1.2 + 0.8 * ranks))
    image = ax.imshow(grid, cmap="coolwarm", vmin=1 - spread, vmax=1 + spread, aspect="auto")
    for r in range(ranks):
        for m in range(mbs):
            v = grid[r, m]
            block = next(b for b in diagnosis.blocks if (b.rank, b.microbatch) == (r, m))
            text = "empty" if not math.isfinite(v) else f"{v:.3f}\n{block.tokens} tok"
            ax.text(m, r, text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(mbs), [f"mb {m}" for m in range(mbs)])
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_title(f"{diagnosis.recipe.split(':')[-1]}: effective weight / (1/N)\n{diagnosis.signature.name}",
                 fontsize=9)
    fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes(path, buf.getvalue())
    return path


def cmd_explain(args: argparse.Namespace) -> int:
    from harness.battery import mesh_scenarios, scenarios
    from harness.battery.plan.options import BatteryOptions, parse_meshes
    from harness.recipes import RecipeError, load_recipe
    from harness.workflow.checks import check_model_option

    filled = control_defaults(args)
    if filled:
        print(filled + "\n")
    known = (*scenarios.SCENARIOS, *mesh_scenarios.MESH_SCENARIOS)
    if args.scenario not in known:
        raise BadInput(f"--scenario={args.scenario!r} is not one of {', '.join(known)}")
    try:
        meshes = parse_meshes(args.mesh)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    args.layout = meshes[0] if meshes else None
    if args.layout is not None and args.world_size not in (None, args.layout.world_size):
        raise BadInput(f"--world-size={args.world_size} but --mesh={args.mesh} has {args.layout.world_size} ranks: "
                       "give one of them")
    args.world_size = args.layout.world_size if args.layout is not None else args.world_size or 2
    if not 1 <= args.world_size <= scenarios.MAX_WORLD_SIZE:
        raise BadInput(f"--world-size={args.world_size} must be between 1 and {scenarios.MAX_WORLD_SIZE}")
    try:  # the battery's own validation, so a bad value gets the battery's message
        options = BatteryOptions.parse(strategy=args.strategy, precision=args.precision, objective=args.objective,
                                       batch_format=args.batch_format, chunking=args.cp_chunking,
                                       pp_schedule=args.pp_schedule, pp_steps=args.pp_steps,
                                       pp_microbatches=args.pp_microbatches,
                                       mesh=None if args.layout is None else [args.layout.label])
        args.pp_steps, args.pp_microbatches = options.pp_steps, options.pp_microbatches
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    try:
        load_recipe(args.recipe)
    except RecipeError as exc:
        raise BadInput(f"--recipe: {exc}") from None
    model = check_model_option(args.model, args.batch_format)
    if args.window is not None and args.window < 0:
        raise BadInput(f"--window={args.window} must be a window index (0, 1, ...)")
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        raise BadInput(f"--rank={args.rank}: ranks are 0..{args.world_size - 1}")
    lanes = [(strategy, lane) for strategy in options.strategy_lanes for lane in options.lanes]
    statuses = []
    for i, (strategy, lane) in enumerate(lanes):
        if i:
            print("\n" + "=" * 100 + "\n")
        statuses.append(_explain_lane(args, model, strategy, lane))
    if len(lanes) > 1:
        bad = [f"{s}/{p}" for (s, p), status in zip(lanes, statuses) if status]
        wrong = f"; wrong in {', '.join(bad)}" if bad else ""
        print(f"\n{len(lanes) - len(bad)} of {len(lanes)} lanes right{wrong}")
    if args.recipe_level and max(statuses):  # the battery's one cause, read the same way
        from harness.workflow.explain_recipe import recipe_level

        said = [in_strategy_form(line, lanes[0][0]) if len({s for s, _ in lanes}) == 1 else line
                for line in recipe_level(args, model, lanes)]
        if said:
            print("\n" + "\n".join(said))
            print(f"FAILED: explain: {args.recipe}: {said[1].split(': ', 1)[0]}")
    return max(statuses)


def _explain_lane(args: argparse.Namespace, model: str | None, strategy: str, precision: str) -> int:
    """One lane: the run, its checks, and the reading of its worst gradient; 0 right, 1 not."""
    import harness.battery.judge.checks  # noqa: F401  (the checks register themselves in REGISTRY when imported)
    from harness.battery.diagnose.of_run import evidence_of
    from harness.battery.judge.failed_runs import crash_summary
    from harness.battery.judge.registry import REGISTRY
    from harness.battery.judge.verdict import FAIL
    from harness.battery.launch import runner
    from harness.battery.plan.options import RunSpec
    from harness.diagnosis.diagnose import diagnose
    from harness.diagnosis.fit import accuracy

    lane = f"{strategy}, {precision}"
    start = time.monotonic()
    spec = RunSpec(args.recipe, args.scenario, args.world_size, precision, model=model,
                   batch_format=args.batch_format, strategy=strategy, deadline=args.deadline, objective=args.objective,
                   layout=getattr(args, "layout", None), chunking=getattr(args, "cp_chunking", "contiguous"),
                   pp_schedule=getattr(args, "pp_schedule", "gpipe"), pp_steps=getattr(args, "pp_steps", 1),
                   pp_microbatches=getattr(args, "pp_microbatches", 2))
    run = runner.run(spec)
    ran = time.monotonic() - start
    if run.failure is not None:
        print(f"the run failed ({run.failure.kind}; {lane}), so there is no gradient to read:")
        for rank in run.failure.ranks[:1]:
            print("\n".join(f"  rank {rank}: {ln}" for ln in crash_summary(run.failure.details.get(rank, ""))))
        first = in_strategy_form(str(run.failure).splitlines()[0], strategy)
        print(f"FAILED: explain: {args.recipe} on {args.scenario}, W={args.world_size}, {lane}: {first}")
        return 1
    if args.window is not None and args.window >= len(run.windows):
        raise BadInput(f"--window={args.window}: scenario {args.scenario} has windows 0..{len(run.windows) - 1}")
    # The battery's verdicts on this very run: a case it rejects is never read as right here.
    failed = [v for info in REGISTRY.values() if info.runs_on(args.scenario)
              for v in [info.fn(run)] if v.status == FAIL]
    start = time.monotonic()
    evidence = evidence_of(run)  # what the diagnosis reads, as any other source would give it
    if precision == "bf16" and evidence.noise_bound is not None:
        with accuracy(evidence.noise_bound):  # read to the accuracy bf16 allows, as the battery's parity does
            found = diagnose(evidence, args.window, args.rank, per_sequence=args.per_sequence)
    else:
        found = diagnose(evidence, args.window, args.rank, per_sequence=args.per_sequence)
    took = time.monotonic() - start
    if found is None:
        print(f"{args.recipe} left no gradient to read on {args.scenario} (W={args.world_size}, {lane}): it refused "
              "every window, or the windows hold no supervised token")
        for v in failed:
            print(f"  the battery: {in_strategy_form(v.message.splitlines()[0], strategy)}")
        print(f"FAILED: explain: no gradient on {args.scenario} ({lane})")
        return 1
    where = f"W={args.world_size}" + (f" {args.layout.label}" if getattr(args, "layout", None) else "")
    print(f"{args.recipe} on scenario {args.scenario}, {where}, {precision}, {strategy}, objective "
          f"{args.objective} (run {ran:.2f} s, diagnosis {took:.2f} s)\n")
    print(found.weight_table())
    line = right_in_objective_words(found, args.objective) if found.right else found.line()
    print(f"\n{in_strategy_form(line, strategy)}")
    if found.fix:  # in the run's strategy, objective and mesh words already (harness.diagnosis.fixes)
        print(f"fix: {found.fix}")
    if precision == "bf16" and run.bf16 is not None:
        print(f"(read from a bf16 gradient: weights to within {float(run.bf16.bound):.1e}, the lane's bound)")
    if found.sequence_signature is not None or found.sequence_residual is not None:
        seq = found.sequence_signature.name if found.sequence_signature else "no per-sequence signature"
        print(f"per sequence: {seq} (fit residual {found.sequence_residual:.2e})")
    print(f"\n{found.location}\n{found.parameter_lines()}")
    if failed:
        print(f"\nthe battery's checks on this run ({args.scenario}, W={args.world_size}, {lane}) reject it:")
        for v in failed:
            print("  " + in_strategy_form(v.message.splitlines()[0], strategy))
            if v.fix and v.fix != found.fix:
                print(f"    fix: {v.fix}")
    out = Path(args.outputs)
    layout = getattr(args, "layout", None)
    stem = _stem(args.recipe, args.scenario, args.world_size, precision, strategy, layout.label if layout else None)
    payload = {"schema": SCHEMA, "recipe": args.recipe, "scenario": args.scenario, "world_size": args.world_size,
               "mesh": layout.label if layout else None,
               "precision": precision, "strategy": strategy, "objective": args.objective, "model": model,
               "batch_format": args.batch_format, "run_seconds": ran, "diagnosis_seconds": took,
               "failed_checks": [v.check for v in failed], **found.to_dict()}
    write_json(out / f"{stem}.json", payload)
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwritten: {out / f'{stem}.json'} (no figure: matplotlib is not installed; pip install matplotlib)")
    else:
        figure = write_weight_figure(out / f"{stem}.png", found)
        print(f"\nwritten: {out / f'{stem}.json'} and {figure}")
    if found.right and not failed:
        from harness.core.objectives import DESCRIPTIONS

        print(f"the weighting is right ({lane}): this step optimizes {DESCRIPTIONS[args.objective]}")
        return 0
    if found.right:
        names = ", ".join(dict.fromkeys(v.check for v in failed))
        print(f"FAILED: explain: the weighting is right, but the battery rejects this case ({lane}): {names}")
        return 1
    sentence = in_strategy_form(found.signature.sentence, strategy)
    print(f"FAILED: explain: {found.signature.name} ({lane}): {sentence}")
    return 1


__all__ = ["SCHEMA", "add_parser", "cmd_explain", "in_strategy_form", "right_in_objective_words", "write_weight_figure"]
