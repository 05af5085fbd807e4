"""``python -m harness audit [options] -- <the script's command>``: a training script, unchanged, run with the audit
loaded in every process (``torchrun --nproc-per-node 2 train.py``, ``python train.py``), and judged.

The harness puts :mod:`harness.audit.site`'s folder first on the command's ``PYTHONPATH``, so that Python loads its
``sitecustomize`` before the script (the environment's own ``sitecustomize`` still runs after it). After ``--skip``
optimizer steps, ``--windows`` windows are recorded on every rank, rank 0 judges them against the single-device
reference through the diagnosis, and the script stops there (``--continue``: it runs on, unwatched). The command runs
in a session of its own, killed whole at ``--deadline``; its output goes to stderr as it comes, the verdict to stdout;
what it writes goes where it always does, and the audit's files go to a temporary folder.

Exit 0 when every window's gradient on every rank is the reference's, 1 when not, when the script failed (its output
is above the verdict, and it is not judged) or when it ended before the audited windows, 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.audit.options import LABELS_HELP, check_labels, objective_parts
from harness.workflow.outputs import BadInput


def add_parser(sub: Any) -> None:
    p = sub.add_parser("audit", help="run a training script unchanged with the audit loaded, and judge its gradients")
    p.add_argument("--windows", type=int, default=2, metavar="K", help="optimizer steps to audit (default: 2)")
    p.add_argument("--skip", type=int, default=0, metavar="S", help="optimizer steps to let pass first (default: 0)")
    p.add_argument("--deadline", type=float, default=600.0, metavar="SECONDS",
                   help="the whole audit's time limit; the script's processes are killed at it (default: 600)")
    p.add_argument("--objective", default="token_mean", metavar="NAME",
                   help="what each window's gradient must be the gradient of: token_mean (default), sequence_mean, "
                   "or fixed_normalizer=C")
    p.add_argument("--labels", default="auto", metavar="auto|hf|aligned|PKG.MODULE:FN", help=LABELS_HELP)
    p.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                   help="builds the reference's model (default: a copy of the script's own, taken before fully_shard "
                   "under FSDP2); its weights are the window's")
    p.add_argument("--unbalance", nargs="?", type=int, const=0, default=None, metavar="SEED",
                   help="mask a drawn suffix of each row's supervised labels (-100) in the batches the script's "
                   "DataLoaders yield until the audited windows end, so that counts differ across ranks and "
                   "microbatches (default seed 0)")
    p.add_argument("--continue", dest="go_on", action="store_true",
                   help="let the script run on, unwatched, after the audited windows (default: it stops there)")
    p.add_argument("--max-capture-mb", type=float, default=4096.0, metavar="MB",
                   help="the most each rank may record (weights, calls, gradients); over it the audit stops recording "
                   "and says so (default: 4096)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- then the script's command, as you run it")
    p.set_defaults(fn=cmd_audit)


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.script)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise BadInput("audit: no command after --: give the script's command as you run it, e.g. "
                       "python -m harness audit -- torchrun --nproc-per-node 2 train.py")
    if args.windows < 1:
        raise BadInput(f"--windows={args.windows}: audit at least one optimizer step")
    if args.skip < 0:
        raise BadInput(f"--skip={args.skip}: the steps to let pass must be 0 or more")
    if not args.deadline > 0:
        raise BadInput(f"--deadline={args.deadline}: give the audit's time limit in seconds, above 0")
    if not args.max_capture_mb > 0:
        raise BadInput(f"--max-capture-mb={args.max_capture_mb:g}: give the bound in MB, above 0")
    try:
        objective_parts(args.objective)
        check_labels(args.labels)
        if args.model is not None and not all(args.model.partition(":")[::2]):
            raise ValueError(f"--model {args.model!r}: give PKG.MODULE:FACTORY, a zero-argument callable")
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return cmd


def cmd_audit(args: argparse.Namespace) -> int:
    from harness.audit import capture

    cmd = _command(args)
    site = str(Path(capture.__file__).parent / "site")
    with tempfile.TemporaryDirectory(prefix="harness-audit-") as folder:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
        env.update({capture.DIR_ENV: folder, capture.WINDOWS_ENV: str(args.windows),
                    capture.SKIP_ENV: str(args.skip), capture.OBJECTIVE_ENV: args.objective,
                    capture.LABELS_ENV: args.labels, capture.MAX_MB_ENV: str(args.max_capture_mb),
                    capture.MODEL_ENV: args.model or ""})
        if args.unbalance is not None:
            env[capture.UNBALANCE_ENV] = str(args.unbalance)
        if args.go_on:
            env[capture.CONTINUE_ENV] = "1"
        start = time.monotonic()
        try:  # the script's output goes to stderr as it comes; stdout holds the verdict
            proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr.fileno(), stderr=sys.stderr.fileno(),
                                    start_new_session=True)
        except OSError as exc:
            raise BadInput(f"audit: cannot run {cmd[0]!r}: {exc}") from None
        verdict = Path(folder) / capture.VERDICT
        found, took = _wait(proc, verdict, args.deadline, start)
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if found is None:
                print(f"FAILED: audit: the script ran past --deadline={args.deadline:g} s and was stopped; not judged")
                return 1
            print(f"FAILED: audit: the script ran on past --deadline={args.deadline:g} s after its audited windows "
                  "(--continue) and was stopped")
            return 1
        if found is None:
            if proc.returncode != 0:
                print(f"FAILED: audit: the script exited {proc.returncode} before its audited windows ended; not "
                      "judged (its output is above)")
            else:
                print(f"FAILED: audit: the script ended before {args.skip} + {args.windows} optimizer steps: no "
                      "window to judge (fewer steps, or no torch optimizer's step())")
            return 1
        if proc.returncode != 0:
            print(f"FAILED: audit: the script exited {proc.returncode} after its audited windows (--continue)")
            return 1
    what = " ".join(cmd)
    if found["passed"]:
        print(f"audit: {what}: every audited window's gradient is the reference's ({took:.1f} s)")
        return 0
    print(f"FAILED: audit: {what} ({took:.1f} s)")
    return 1


def _wait(proc: subprocess.Popen[bytes], verdict: Path, deadline: float,
          start: float) -> tuple[dict[str, Any] | None, float]:
    """Wait for the script to end or ``deadline`` to pass, printing the verdict as soon as it is written (under
    ``--continue`` the script runs on after it). Returns the verdict (None: none written) and the seconds to it."""
    found, took = None, 0.0
    while time.monotonic() - start < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
        if found is None and verdict.is_file():
            found, took = json.loads(verdict.read_text()), time.monotonic() - start
            print("\n".join(found["lines"]), flush=True)
        if proc.returncode is not None:
            break
    return found, took


__all__ = ["add_parser", "cmd_audit"]
