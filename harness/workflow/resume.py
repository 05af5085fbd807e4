"""``python -m harness resume --trainer PKG.MODULE:FACTORY``, and the resume step of ``report``: the resume battery
(:mod:`harness.resume.battery`) on a user's training loop or on the harness's own trainer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from harness.workflow.outputs import BadInput, err
from harness.workflow.results import Check


def add_parser(sub: Any) -> None:
    from harness.resume.contract import HARNESS_TRAINER

    p = sub.add_parser("resume", help="the resume battery: stop, resume, resume again and kill a training loop; "
                       "every state compared bitwise with a run that never stopped")
    p.add_argument("--trainer", default=HARNESS_TRAINER, metavar="PKG.MODULE:FACTORY",
                   help=f"the training loop (default: the harness's own, {HARNESS_TRAINER})")
    add_options(p)
    p.add_argument("--json", metavar="PATH", help="write every case's verdict as JSON to PATH")
    p.set_defaults(fn=cmd_resume)


def add_options(p: argparse.ArgumentParser) -> None:
    """The battery's shape, named as the pytest plugin names it."""
    p.add_argument("--resume-steps", type=int, default=20, metavar="S", help="continuous run length (default: 20)")
    p.add_argument("--resume-every", type=int, default=5, metavar="K", help="checkpoint every K steps (default: 5)")
    p.add_argument("--resume-world-size", type=int, default=2, metavar="W", help="ranks per run (default: 2)")
    p.add_argument("--resume-seed", type=int, default=0, metavar="N", help="seed of the draws (default: 0)")
    p.add_argument("--resume-cases", default=None, metavar="CASE,...",
                   help="run only these cases ('repeatable' always runs first; default: every case)")


def options_of(args: argparse.Namespace) -> Any:
    from harness.resume.options import CASES, ResumeOptions

    try:
        cases = tuple(c for c in (getattr(args, "resume_cases", None) or "").split(",") if c)
        return ResumeOptions(steps=args.resume_steps, every=args.resume_every, world_size=args.resume_world_size,
                             seed=args.resume_seed, cases=cases or CASES)
    except ValueError as exc:
        raise BadInput(f"--resume-*: {exc}") from None


def resume_battery(trainer: str, options: Any = None, progress: Any = None) -> tuple[Check, dict[str, Any]]:
    """Run the battery on ``trainer``; the report's check (failing with the first failed case's message: every state
    that differs, per rank) and the battery's JSON. A bad ``trainer`` path is BadInput; a trainer that refuses to run
    under the options fails the check with its one usage error (``payload["usage_error"]``)."""
    from harness.resume.battery import run_battery
    from harness.resume.contract import TrainerError

    try:
        report = run_battery(trainer, options, progress)
    except TrainerError as exc:
        raise BadInput(str(exc)) from None
    failed = report.failures()
    if report.usage_error is not None:
        detail = f"usage error: {report.usage_error}"
    elif failed:
        detail = f"{failed[0].case}: {failed[0].message}"
    else:
        detail = f"{len(report.results)} cases bitwise equal to the continuous run in {report.seconds:.1f} s"
    return Check(f"resume battery of {trainer.split(':')[-1]}", report.passed, detail), {
        **report.to_dict(), "table": report.table()}


def cmd_resume(args: argparse.Namespace) -> int:
    """Exit 0 when every case holds, 1 when one fails (its differing states named), 2 for bad input (a trainer that
    refuses to run under the options included: one usage error, after the table and the JSON)."""

    check, payload = resume_battery(args.trainer, options_of(args))
    print(payload["table"])
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"report written to {args.json}")
    if payload.get("usage_error") is not None:
        err(f"resume: {check.detail}")
        return 2
    if not check.passed:
        err(f"FAILED: resume: {check.detail}")
        return 1
    print(f"every case holds: {check.detail}")
    return 0


__all__ = ["add_options", "add_parser", "cmd_resume", "options_of", "resume_battery"]
