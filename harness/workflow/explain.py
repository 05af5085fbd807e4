"""``python -m harness explain``: what a recipe's step actually optimized, read off its gradient.

One battery run of the recipe (a scenario at one world size and precision), then the diagnosis of the window whose
gradient is furthest from the reference (:mod:`harness.battery.diagnose`): the effective weight of every rank's
microbatch against the right one, the signature those weights match, the per-parameter table, a figure (one cell
per rank x microbatch, effective weight over expected) and the same numbers as JSON. Exit 0 when the weighting is
right, 1 when it is not (or the run left no gradient to read), 2 for bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
import re
import time
from pathlib import Path

from harness.workflow.outputs import BadInput, write_bytes, write_json

SCHEMA = "harness.explain/1"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="the effective token weights of a recipe's gradient and the mistake they name")
    p.add_argument("--recipe", required=True, metavar="PKG.MODULE:ATTR", help="the recipe to explain")
    p.add_argument("--scenario", default="uneven", help="battery scenario (default: uneven)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp64"), help="default: fp32")
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                   help="the model the recipe trains: a zero-argument callable returning a torch.nn.Module "
                   "(default: the built-in TinyCausalLM)")
    p.add_argument("--batch-format", default="harness", choices=("harness", "hf"),
                   help="what the recipe receives: harness Microbatches or HF-style dicts (default: harness)")
    p.add_argument("--objective", default="token_mean", metavar="NAME",
                   help="the declared objective the weights are read against (default: token_mean)")
    p.add_argument("--window", type=int, default=None, help="window to read (default: the worst one)")
    p.add_argument("--rank", type=int, default=None, help="rank whose gradient is read (default: the worst one)")
    p.add_argument("--per-sequence", action="store_true", help="also fit one weight per sequence")
    p.add_argument("--outputs", default="outputs/explain", metavar="DIR",
                   help="where the figure and JSON go (default: outputs/explain/)")
    p.add_argument("--deadline", type=float, default=30.0, help="seconds the run may take before it is called hung")
    p.set_defaults(fn=cmd_explain)


def _stem(recipe: str, scenario: str, world: int, precision: str) -> str:
    """The output files' name: the recipe's module and attribute (two modules' ``:recipe`` must not overwrite each
    other), the scenario, world size and precision: ``explain-pkg.mod-recipe-uneven-W2-fp32``."""
    module, _, attr = recipe.partition(":")
    name = "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", part) for part in (module, attr) if part)
    return f"explain-{name}-{scenario}-W{world}-{precision}"


def write_weight_figure(path: Path, diagnosis: object) -> Path:
    """One cell per rank x microbatch: the fitted weight over the expected ``1/N`` (1 is right), annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from harness.battery.diagnose import Diagnosis

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
    from harness.battery import runner, scenarios
    from harness.battery.checks import crash_summary
    from harness.battery.diagnose import diagnose
    from harness.battery.options import check_objective
    from harness.recipes import RecipeError, load_recipe
    from harness.workflow.checks import check_model_option

    if args.scenario not in scenarios.SCENARIOS:
        raise BadInput(f"--scenario={args.scenario!r} is not one of {', '.join(scenarios.SCENARIOS)}")
    if not 1 <= args.world_size <= scenarios.MAX_WORLD_SIZE:
        raise BadInput(f"--world-size={args.world_size} must be between 1 and {scenarios.MAX_WORLD_SIZE}")
    try:
        load_recipe(args.recipe)
    except RecipeError as exc:
        raise BadInput(f"--recipe: {exc}") from None
    model = check_model_option(args.model, args.batch_format)
    try:
        check_objective(args.objective)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    start = time.monotonic()
    run = runner.run(args.recipe, args.scenario, args.world_size, args.precision, model=model,
                     batch_format=args.batch_format, deadline=args.deadline, objective=args.objective)
    ran = time.monotonic() - start
    if run.failure is not None:
        print(f"the run failed ({run.failure.kind}), so there is no gradient to read:")
        for rank in run.failure.ranks[:1]:
            print("\n".join(f"  rank {rank}: {ln}" for ln in crash_summary(run.failure.details.get(rank, ""))))
        first = str(run.failure).splitlines()[0]
        print(f"FAILED: explain: {args.recipe} on {args.scenario}, W={args.world_size}: {first}")
        return 1
    if args.window is not None and not 0 <= args.window < len(run.windows):
        raise BadInput(f"--window={args.window}: scenario {args.scenario} has windows 0..{len(run.windows) - 1}")
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        raise BadInput(f"--rank={args.rank}: ranks are 0..{args.world_size - 1}")
    start = time.monotonic()
    found = diagnose(run, args.window, args.rank, per_sequence=args.per_sequence)
    took = time.monotonic() - start
    if found is None:
        print(f"{args.recipe} left no gradient to read on {args.scenario} (W={args.world_size}): it refused every "
              "window, or the windows hold no supervised token")
        print(f"FAILED: explain: no gradient on {args.scenario}")
        return 1
    print(f"{args.recipe} on scenario {args.scenario}, W={args.world_size}, {args.precision} "
          f"(run {ran:.2f} s, diagnosis {took:.2f} s)\n")
    print(found.weight_table())
    print(f"\n{found.line()}")
    if found.sequence_signature is not None or found.sequence_residual is not None:
        seq = found.sequence_signature.name if found.sequence_signature else "no per-sequence signature"
        print(f"per sequence: {seq} (fit residual {found.sequence_residual:.2e})")
    print(f"\n{found.location}\n{found.parameter_lines()}")
    out = Path(args.outputs)
    stem = _stem(args.recipe, args.scenario, args.world_size, args.precision)
    payload = {"schema": SCHEMA, "recipe": args.recipe, "scenario": args.scenario, "world_size": args.world_size,
               "precision": args.precision, "model": model, "batch_format": args.batch_format,
               "run_seconds": ran, "diagnosis_seconds": took, **found.to_dict()}
    write_json(out / f"{stem}.json", payload)
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwritten: {out / f'{stem}.json'} (no figure: matplotlib is not installed; pip install matplotlib)")
    else:
        figure = write_weight_figure(out / f"{stem}.png", found)
        print(f"\nwritten: {out / f'{stem}.json'} and {figure}")
    if found.right:
        print("the weighting is right: this step optimizes the global token mean")
        return 0
    print(f"FAILED: explain: {found.signature.name}: {found.signature.sentence}")
    return 1


__all__ = ["SCHEMA", "add_parser", "cmd_explain", "write_weight_figure"]
