"""Command line: ``python -m harness <command>`` (or the ``ddp-harness`` console script).

Seed 000's workflow: prepare, reference, check-loss, evaluate, exercise, check-environment, check-checkpoints, clean,
and ``report``, which runs the whole protocol and writes report.md, report.json and report.png; plus ``battery``,
``explain`` (the effective token weights of a recipe's gradient) and ``resume`` (the resume battery of a training loop).

Exit codes: 0 when every check a command ran holds; 1 when a check fails (the last line names it); 2 for input that
cannot be used as given (a missing or invalid config, an outputs folder from another data lock, an incomplete
checkpoint), in which case nothing was written and existing outputs are untouched, except where the message names
what was written before the problem was found (``report`` finds an incomplete checkpoint of its own trio only after
its prepare and reference steps have written their files).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from harness.battery.plan.options import (
    BATCH_FORMAT_HELP,
    BATCH_FORMATS,
    CHUNKING_HELP,
    KEEP_GOING_HELP,
    MESH_HELP,
    PP_MICROBATCHES_HELP,
    PP_SCHEDULE_HELP,
    PP_STEPS_HELP,
    QUICK_HELP,
    SKIP_HELP,
    add_lane_options,
)
from harness.workflow import audit, explain, resume
from harness.workflow.checks import cmd_battery, cmd_check_checkpoints, cmd_check_environment, cmd_clean
from harness.workflow.commands import (
    DEFAULT_CONFIG,
    cmd_check_loss,
    cmd_evaluate,
    cmd_exercise,
    cmd_prepare,
    cmd_reference,
    cmd_report,
)
from harness.workflow.outputs import BadInput, err
from harness.workflow.scaling import SCALING_STEPS


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
    p.add_argument("--scaling-steps", type=int, default=SCALING_STEPS,
                   help=f"timed steps per world size in the scaling table (default: {SCALING_STEPS})")
    p.add_argument("--battery-controls", metavar="NAME,...",
                   help="negative controls the battery runs (default: every one; e.g. mean_of_local_means)")
    p.add_argument("--resume-trainer", default=None, metavar="PKG.MODULE:FACTORY",
                   help="the trainer the report's resume battery runs on (default: the harness's own; e.g. a control "
                   "of harness.training.resume_controls, which must turn the report red)")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("battery", help="judge recipes on every check; run the negative controls on their targets")
    p.add_argument("--recipe", action="append", metavar="PKG.MODULE:ATTR",
                   help="a recipe under test (repeatable); default: the correct recipe, with every control")
    p.add_argument("--battery-controls", dest="controls", nargs="?", const="", metavar="NAME,...",
                   help="run the negative controls (all, or the named ones); the default when no --recipe is given")
    _deprecated(p, "--controls", "--battery-controls", dest="controls", nargs="?", const="")
    p.add_argument("--battery-world-sizes", dest="world_sizes", default="1,2,3,4", metavar="W,...",
                   help="comma-separated world sizes, the drawn layouts' included (default: 1,2,3,4)")
    _deprecated(p, "--world-sizes", "--battery-world-sizes", dest="world_sizes")
    p.add_argument("--mesh", action="append", metavar="DIM=N,...",
                   help=MESH_HELP)
    p.add_argument("--cp-chunking", default="contiguous", metavar="contiguous|load_balanced", help=CHUNKING_HELP)
    p.add_argument("--pp-schedule", default="gpipe", metavar="gpipe|1f1b|...", help=PP_SCHEDULE_HELP)
    p.add_argument("--pp-steps", default="1", metavar="A", help=PP_STEPS_HELP)
    p.add_argument("--pp-microbatches", default="2", metavar="M", help=PP_MICROBATCHES_HELP)
    add_lane_options(p)  # --strategy, --precision, --objective: explain declares the same
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                   help="the model to check the recipes on: a zero-argument callable returning a torch.nn.Module (or "
                   "an nn.Module class), seeded and built on every rank and for the reference, dropout disabled "
                   "(default: the built-in TinyCausalLM; the negative controls always run on the built-in model)")
    p.add_argument("--batch-format", default="harness", choices=BATCH_FORMATS, help=BATCH_FORMAT_HELP)
    p.add_argument("--find-unused-parameters", default="auto", choices=("auto", "on", "off"),
                   help="DDP's find_unused_parameters for the ranks: auto (default) turns it on, and says so, when the "
                   "reference finds a parameter without a gradient in some microbatch; on; off")
    p.add_argument("--battery-deadline", dest="deadline", type=float, default=30.0, metavar="SECONDS",
                   help="seconds one run (a case, a drawn layout) may take before it is called hung (default: 30)")
    _deprecated(p, "--deadline", "--battery-deadline", dest="deadline", type=float)
    p.add_argument("--battery-examples", dest="examples", type=int, default=12, metavar="N",
                   help="drawn layouts per recipe (0: none; needs hypothesis)")
    _deprecated(p, "--examples", "--battery-examples", dest="examples", type=int)
    p.add_argument("--battery-report", dest="json", metavar="PATH", help="write the battery report (expected and run "
                   "counts, verdicts, model notes, errors, exit status) as JSON, the format pytest's option writes")
    _deprecated(p, "--json", "--battery-report", dest="json")
    p.add_argument("--battery-junit", dest="junit", metavar="PATH", default=None,
                   help="write the verdicts and controls as JUnit XML, one test case each, for CI systems (pytest's "
                   "lane: --junitxml=PATH)")
    p.add_argument("--battery-skip", dest="skip", action="append", metavar="CHECK[=REASON]", help=SKIP_HELP)
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    p.add_argument("--battery-keep-going", dest="keep_going", action="store_true", help=KEEP_GOING_HELP)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print each run as it starts, every row of the table and every failure's whole message")
    p.set_defaults(fn=cmd_battery)

    explain.add_parser(sub)
    resume.add_parser(sub)
    audit.add_parser(sub)
    return parser


class _DeprecatedAlias(argparse.Action):
    """An old option name: stores like the new one and says, on stderr, which name to use instead."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        err(f"note: {option_string} is deprecated; use {self.new} (the name pytest's battery option has too)")
        setattr(namespace, self.dest, values)


def _deprecated(p: argparse.ArgumentParser, old: str, new: str, **kwargs: Any) -> None:
    p.add_argument(old, action=_DeprecatedAlias, new=new, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                   **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from harness.distributed.launcher import LaunchError

    try:
        return int(args.fn(args))
    except BadInput as exc:
        err(f"error: {exc}")
        return 2
    except LaunchError as exc:
        err(str(exc))
        err(f"FAILED: {args.command}: a launched run failed: {str(exc).splitlines()[0]}")
        return 1
