"""Command line: ``python -m harness <command>`` (or the ``ddp-harness`` console script).

Commands print what they measured and exit 0 only when every check they ran holds; a failure names the failing check
on the last line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from harness.loss import global_token_loss

CORRECT = "harness.recipes:global_token_mean"


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_check_loss(args: argparse.Namespace) -> int:
    """Seed 000's counterexample: 12 and 36 tokens with loss sums 12 and 108."""
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
    """Every check of the battery for the correct recipe and each negative control, as a table."""
    import json
    import time
    from pathlib import Path

    from harness.battery.table import format_table, run_table
    from harness.recipes import NEGATIVE_CONTROLS, RecipeError, load_recipe

    recipes = args.recipe or [CORRECT, *(f"harness.recipes:{n}" for n in NEGATIVE_CONTROLS)]
    for r in recipes:
        try:
            load_recipe(r)
        except RecipeError as exc:
            _err(f"--recipe: {exc}")
            return 2
    worlds = _world_sizes(args.world_sizes)
    start = time.monotonic()
    verdicts = run_table(recipes, worlds, args.deadline, progress=(lambda s: _err(f"  running {s}")) if args.verbose
                         else None)
    print(format_table(verdicts))
    print(f"\n{len(verdicts)} checks over {len(recipes)} recipe(s) at world sizes {worlds} in "
          f"{time.monotonic() - start:.1f} s (CPU, gloo)")
    if args.json:
        Path(args.json).write_text(json.dumps([v.to_dict() for v in verdicts], indent=2) + "\n")
        print(f"verdicts written to {args.json}")
    correct_failed = [v for v in verdicts if v.recipe == CORRECT and not v.passed]
    controls_passed_all = [r for r in recipes if r != CORRECT and all(v.passed for v in verdicts if v.recipe == r)]
    for v in correct_failed:
        _err(v.message)
    if correct_failed:
        _err(f"FAILED: {len(correct_failed)} check(s) of {CORRECT}: first {correct_failed[0].check} "
             f"({correct_failed[0].scenario}, W={correct_failed[0].world_size})")
        return 1
    if controls_passed_all:
        _err(f"FAILED: negative control(s) not rejected by any check: {controls_passed_all}")
        return 1
    if any(r != CORRECT for r in recipes):
        print("every check holds for the correct recipe; every negative control is rejected by at least one check")
    elif all(v.passed for v in verdicts):
        print("every check holds")
    return 0


def _world_sizes(text: str) -> list[int]:
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        worlds = []
    if not worlds or any(w < 1 or w > 8 for w in worlds):
        msg = f"--world-sizes={text!r} must be a comma-separated list of integers between 1 and 8, e.g. 1,2,3"
        raise SystemExit(msg)
    return worlds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check-loss", help="the 12/36-token counterexample: mean of means 2, token mean 2.5")
    p.set_defaults(fn=cmd_check_loss)

    p = sub.add_parser("battery", help="run every check on the correct recipe and each negative control")
    p.add_argument("--recipe", action="append", metavar="PKG.MODULE:ATTR",
                   help="recipe(s) to check instead of the correct one and the controls (repeatable)")
    p.add_argument("--world-sizes", default="2", help="comma-separated world sizes (default: 2)")
    p.add_argument("--deadline", type=float, default=10.0, help="seconds one run may take before it is called hung")
    p.add_argument("--json", metavar="PATH", help="also write every verdict as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="print each run as it starts")
    p.set_defaults(fn=cmd_battery)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))
