"""Run seed 000's torchrun trio N times and count the runs that did not exit cleanly.

    python benchmarks/torchrun_trio.py [--repeats 20] [--config configs/minimum.yaml] [--timeout 180]

Each trio is docs/training-and-resume.md's three command lines, in a fresh temporary directory: ``torchrun --nnodes=1
--nproc-per-node=2 -m harness.train --config ...`` stopped at 50, ``--continuous`` to 100, and ``--resume
stopped/step-0050`` to 100, started the way ``tests/distributed/test_resume.py`` starts them (static rendezvous on
127.0.0.1, a free port, a new port when the one found free was taken). Every torchrun runs in its own process group
under ``--timeout`` seconds; on expiry the whole group is killed and the run counts as a failure.

Counts every torchrun invocation (3 per trio) whose exit status is non-zero, and how many of those were aborts
(SIGABRT, exit -6 or 134, or "terminate called" in the output); checks that the resumed run's step-0100 checkpoint
(shared state, every rank's file, eval.json) equals the continuous run's bit for bit; writes
``benchmarks/results/torchrun_trio.json`` (or ``--out``) and prints a one-line summary. Exit status 0 only when every
run exited 0 and every trio was bitwise equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "tests", ROOT):  # tests/ for support.ports (tests/support/ports.py)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from support.ports import HOST, free_port, port_taken  # noqa: E402

from harness.resume.checkpoint import MANIFEST, SHARED, rank_file  # noqa: E402
from harness.training.evaluation import EVAL_FILE  # noqa: E402
from harness.training.trainer import state_difference  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "torchrun_trio.json"
ABORT_MARKERS = ("terminate called", "sigabrt", "signal 6")
PORT_RETRIES = 3


@dataclass
class Run:
    """One torchrun invocation: its exit status, whether it aborted or timed out, and the tail of its output."""

    name: str
    returncode: int
    seconds: float
    timed_out: bool
    output: str

    @property
    def aborted(self) -> bool:
        text = self.output.lower()
        return self.returncode in (-signal.SIGABRT, 128 + signal.SIGABRT) or any(m in text for m in ABORT_MARKERS)


def _run_once(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, bool, str]:
    """Run ``command`` in a new session; on timeout kill its whole process group (torchrun and its workers)."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, False, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return proc.returncode, True, out


def torchrun(name: str, cwd: Path, config: Path, timeout: float, *args: str) -> Run:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t = time.perf_counter()
    for _ in range(PORT_RETRIES):  # a port found free can be taken before torchrun binds it
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
            "--rdzv-backend=static", f"--master-addr={HOST}", f"--master-port={free_port()}",
            "-m", "harness.train", "--config", str(config), *args,
        ]
        code, timed_out, out = _run_once(command, cwd, env, timeout)
        if code == 0 or not port_taken(out):
            break
    return Run(name, code, time.perf_counter() - t, timed_out, out)


def bitwise_equal(a: Path, b: Path, eval_a: Path, eval_b: Path) -> str:
    """"" when step directories ``a`` and ``b`` (and the two eval.json files) carry equal bits, else what differs.

    The comparison of ``test_torchrun_stop_and_resume_lands_on_the_continuous_checkpoint``: model, optimizer and
    scheduler in the shared file, each rank's file (RNG states, position, losses), and the evaluation.
    """
    for d in (a, b):
        if not (d / MANIFEST).is_file():
            return f"{d} holds no complete checkpoint"
    shared_a, shared_b = (torch.load(d / SHARED, weights_only=True) for d in (a, b))
    for part in ("model", "optimizer", "scheduler"):
        if state_difference(shared_a[part], shared_b[part]) != 0.0:
            return f"shared {part} differs"
    for rank in range(2):
        ra, rb = (torch.load(d / rank_file(rank), weights_only=True) for d in (a, b))
        if state_difference(ra, rb) != 0.0:
            return f"rank {rank}'s file differs"
    if json.loads(eval_a.read_text()) != json.loads(eval_b.read_text()):
        return "eval.json differs"
    return ""


def trio(config: Path, timeout: float) -> tuple[list[Run], str, float]:
    """The three runs in a fresh directory: (runs, "" or why the resumed run is not bitwise equal, seconds)."""
    work = Path(tempfile.mkdtemp(prefix="torchrun-trio-"))
    try:
        t = time.perf_counter()
        runs = {name: work / name for name in ("stopped", "continuous", "resumed")}
        done = [
            torchrun("stopped", work, config, timeout, "--run-dir", str(runs["stopped"])),
            torchrun("continuous", work, config, timeout, "--run-dir", str(runs["continuous"]), "--continuous"),
        ]
        step = runs["stopped"] / "step-0050"
        if (step / MANIFEST).is_file():
            done.append(torchrun("resumed", work, config, timeout, "--run-dir", str(runs["resumed"]),
                                 "--resume", str(step)))
        seconds = time.perf_counter() - t
        try:
            why = bitwise_equal(runs["continuous"] / "step-0100", runs["resumed"] / "step-0100",
                                runs["continuous"] / EVAL_FILE, runs["resumed"] / EVAL_FILE)
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            why = f"comparison failed: {type(exc).__name__}: {exc}"
        return done, why, seconds
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20, help="trios to run (default 20)")
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "minimum.yaml")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds one torchrun invocation may take")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON result (default {DEFAULT_OUT})")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be at least 1")
    if args.timeout <= 0:
        p.error(f"--timeout={args.timeout} must be a positive number of seconds")

    started = datetime.datetime.now(datetime.timezone.utc)
    runs: list[Run] = []
    equal, seconds = 0, []
    samples: list[dict[str, object]] = []
    for i in range(args.repeats):
        done, why, s = trio(args.config, args.timeout)
        runs += done
        seconds.append(s)
        equal += not why and len(done) == 3
        bad = [r for r in done if r.returncode != 0]
        for r in bad:
            if len(samples) < 5:
                samples.append({"trio": i + 1, "run": r.name, "returncode": r.returncode, "timed_out": r.timed_out,
                                "output_tail": r.output[-8000:]})
        status = "clean" if not bad and not why else "; ".join(
            [f"{r.name} exit {r.returncode}{' (abort)' if r.aborted else ''}" for r in bad] + ([why] if why else []))
        print(f"trio {i + 1}/{args.repeats}: {s:.1f} s, {status}", flush=True)

    failures = [r for r in runs if r.returncode != 0]
    result = {
        "command": "torchrun --nnodes=1 --nproc-per-node=2 --rdzv-backend=static -m harness.train --config "
        f"{args.config.name} (stopped at 50; --continuous; --resume stopped/step-0050)",
        "repeats": args.repeats,
        "runs": len(runs),
        "failures": len(failures),
        "aborts": sum(r.aborted for r in failures),
        "timeouts": sum(r.timed_out for r in failures),
        "bitwise_equal": equal,
        "median_seconds_per_trio": round(statistics.median(seconds), 2),
        "seconds_per_trio": [round(s, 2) for s in seconds],
        "failure_samples": samples,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": started.isoformat(timespec="seconds"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"torchrun trio x{args.repeats}: {result['failures']} of {len(runs)} runs failed "
          f"({result['aborts']} aborts, {result['timeouts']} timeouts), {equal}/{args.repeats} bitwise equal, "
          f"median {result['median_seconds_per_trio']:.1f} s per trio; wrote {args.out}")
    return 0 if not failures and equal == args.repeats else 1


if __name__ == "__main__":
    sys.exit(main())
