"""``python -m harness audit -- torchrun ... train.py``: a plain DDP script (tests/scripts/ddp_train.py), not one line
changed, run under torchrun with two gloo ranks and the audit loaded through ``sitecustomize``. The right script exits
0; the one that divides by each rank's own token count exits 1 with the mean-of-local-means reading and its fix; a
script that fails, one that outlives the deadline and a missing command are named and never judged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"
SCRIPT = SCRIPTS / "ddp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]


def audit(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", "audit", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=180, check=False)


@pytest.mark.parametrize(("wrong", "status", "said"), [
    ((), 0, "every audited window's gradient is the reference's"),
    pytest.param(("--wrong", "local_count"), 1, "reading (mean_of_local_means)", marks=pytest.mark.slow),
])
def test_an_unchanged_ddp_script_is_judged_under_torchrun(tmp_path: Path, wrong: tuple[str, ...], status: int,
                                                          said: str) -> None:
    done = audit("--windows", "2", "--", *TORCHRUN, str(SCRIPT), *wrong, cwd=tmp_path)
    assert status == done.returncode, done.stdout + done.stderr
    assert said in done.stdout, done.stdout
    assert 4 == done.stdout.count("parity "), done.stdout  # two windows on each of the two ranks
    if wrong:
        assert "fix: divide each microbatch's loss sum by the window's supervised count" in done.stdout
    assert [] == list(tmp_path.iterdir())  # nothing written where the script ran


@pytest.mark.slow
@pytest.mark.parametrize(("wrong", "said"), [
    ("accumulation_mean", "reading (per_microbatch_mean)"),
    ("never_no_sync", "one_sync FAILED: the gradient was synchronized in 2 of the window's 2 model calls; expected 1"),
])
def test_the_other_realistic_mistakes_of_the_ddp_script_are_named(tmp_path: Path, wrong: str, said: str) -> None:
    """Each microbatch's mean over the accumulation steps, and a loop without no_sync (its gradient is right: only
    the count of synchronizations shows it)."""
    done = audit("--", *TORCHRUN, str(SCRIPT), "--wrong", wrong, cwd=tmp_path)
    assert 1 == done.returncode, done.stdout + done.stderr
    assert said in done.stdout, done.stdout
    assert "fix: " in done.stdout


@pytest.mark.slow
def test_a_failing_script_is_not_judged(tmp_path: Path) -> None:
    failed = audit("--", sys.executable, "-c", "print('boom'); raise SystemExit(3)", cwd=tmp_path)
    assert 1 == failed.returncode and "exited 3 before its audited windows ended; not judged" in failed.stdout
    assert "boom" in failed.stderr


@pytest.mark.parametrize(("option", "said"), [
    (("--objective", "median"), "the audit judges token_mean (default), sequence_mean"),
    (("--labels", "shifted"), "give auto, hf, aligned or PKG.MODULE:FN"),
    (("--max-capture-mb", "0"), "--max-capture-mb=0: give the bound in MB"),
    (("--model", "nocolon"), "--model 'nocolon': give PKG.MODULE:FACTORY"),
    ((), "no command after --"),
])
def test_bad_options_are_refused_before_the_script_starts(option: tuple[str, ...], said: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from harness.workflow.cli import main

    command = ["--", sys.executable, "-c", "raise SystemExit(9)"] if option else []
    assert 2 == main(["audit", *option, *command])
    assert said in capsys.readouterr().err


@pytest.mark.slow
def test_a_late_script_and_a_stepless_one_are_not_judged(tmp_path: Path) -> None:
    late = audit("--deadline", "1", "--", sys.executable, "-c", "import time; time.sleep(60)", cwd=tmp_path)
    assert 1 == late.returncode and "ran past --deadline=1 s and was stopped" in late.stdout
    stepless = audit("--", sys.executable, "-c", "print('no optimizer here')", cwd=tmp_path)
    assert 1 == stepless.returncode and "ended before 0 + 2 optimizer steps" in stepless.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("script", "argv", "status", "said"), [
    ("nanogpt_train.py", (), 0, "labels read: the targets the model is given, aligned (negative ignored)"),
    ("nanogpt_train.py", ("--wrong", "accumulation_mean"), 1, "reading (per_microbatch_mean)"),
    ("fsdp2_train.py", (), 0, "2 rank(s) (FSDP2)"),
    ("fsdp2_train.py", ("--hsdp",), 0, "2 rank(s) (FSDP2)"),
    ("fsdp2_train.py", ("--wrong", "local_count"), 1, "reading (mean_of_local_means)"),
    ("fsdp2_train.py", ("--wrong", "always_sync"), 1, "fix: call model.set_requires_gradient_sync(False) before"),
])
def test_a_nanogpt_loop_and_an_fsdp2_script_are_judged_unchanged(tmp_path: Path, script: str, argv: tuple[str, ...],
                                                                  status: int, said: str) -> None:
    """nanoGPT's loop (model(X, Y) with aligned targets, -1 ignored, require_backward_grad_sync toggled, a clip at
    1.0): right passes with its clip judged, its own loss / gradient_accumulation_steps reads per_microbatch_mean.
    FSDP2 (fully_shard per block and the root; HSDP on a dp_replicate x dp_shard mesh): the reference model is the
    one copied before the first fully_shard, the weights and gradients are gathered whole."""
    done = audit("--", *TORCHRUN, str(SCRIPTS / script), *argv, cwd=tmp_path)
    assert status == done.returncode, done.stdout + done.stderr
    assert said in done.stdout, done.stdout
    if script == "nanogpt_train.py" and not argv:
        assert 4 == done.stdout.count("clipping PASSED"), done.stdout


@pytest.mark.slow
def test_unbalance_shows_a_mean_of_local_means_that_balanced_data_hides(tmp_path: Path) -> None:
    """Every row 16 tokens, every token supervised: dividing by each rank's own count passes parity, and the verdict
    says a mean of local means could not be seen; --unbalance masks a drawn suffix of each row's labels in the
    batches the script's DataLoader yields and the same script fails with the reading. The right script passes under
    the same masking."""
    wrong = (*TORCHRUN, str(SCRIPT), "--balanced", "--wrong", "local_count")
    hidden = audit("--", *wrong, cwd=tmp_path)
    assert 0 == hidden.returncode, hidden.stdout + hidden.stderr
    assert "could not show: every rank held the same token count in every audited window" in hidden.stdout
    shown = audit("--unbalance", "--", *wrong, cwd=tmp_path)
    assert 1 == shown.returncode and "reading (mean_of_local_means)" in shown.stdout, shown.stdout
    assert "note: --unbalance: each row of the 4 batches" in shown.stdout
    right = audit("--unbalance", "5", "--", *TORCHRUN, str(SCRIPT), "--balanced", cwd=tmp_path)
    assert 0 == right.returncode and "(seed 5)" in right.stdout, right.stdout + right.stderr


@pytest.mark.slow
def test_continue_lets_the_script_finish_and_a_tight_capture_bound_is_refused(tmp_path: Path) -> None:
    """--continue: the verdict first, then the script's own end ("trained 4 steps", which the default stop never
    reaches); --max-capture-mb below one window's weights: not judged, with the bound named."""
    stopped = audit("--", *TORCHRUN, str(SCRIPT), cwd=tmp_path)
    assert 0 == stopped.returncode and "trained 4 steps" not in stopped.stderr
    went_on = audit("--continue", "--", *TORCHRUN, str(SCRIPT), cwd=tmp_path)
    assert 0 == went_on.returncode and "trained 4 steps" in went_on.stderr, went_on.stdout + went_on.stderr
    tight = audit("--max-capture-mb", "0.001", "--", *TORCHRUN, str(SCRIPT), cwd=tmp_path)
    assert 1 == tight.returncode and "not judged: the capture reached" in tight.stdout, tight.stdout


@pytest.mark.slow
def test_two_nodes_each_print_the_verdict(tmp_path: Path) -> None:
    """torchrun on two nodes (two agents here, one rank each, static rendezvous), each under its own audit command:
    the ranks' records meet through the script's process group, not a shared folder, and both commands print the
    verdict."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-m", "harness", "audit", "--deadline", "120", "--", sys.executable,
                               "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                               str(SCRIPT)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert 0 == p.returncode, out + err
        assert 4 == out.count("parity PASSED") and "2 rank(s) (DDP)" in out


@pytest.mark.slow
def test_the_pytest_lane_runs_the_audit_of_a_script(tmp_path: Path) -> None:
    """pytest --pyargs harness.audit --audit-command=...: the right script's test passes; the wrong one's fails with
    the verdict's reading and fix."""
    def lane(*argv: str) -> subprocess.CompletedProcess[str]:
        command = " ".join([*TORCHRUN, str(SCRIPT), *argv])
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                               "harness.audit", f"--audit-command={command}"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=240, check=False)

    right = lane()
    assert 0 == right.returncode and "1 passed" in right.stdout, right.stdout + right.stderr
    wrong = lane("--wrong", "accumulation_mean")
    assert 1 == wrong.returncode and "reading (per_microbatch_mean)" in wrong.stdout, wrong.stdout
    assert "fix: divide each microbatch's loss sum" in wrong.stdout


def _in_code_rank(wrong: bool) -> tuple[bool, str]:
    """One rank of a DDP loop run some other way than by the command: ``harness.audit.watch`` around it, and
    ``verdict()`` called on every rank."""
    import torch
    import torch.distributed as dist
    from support.audit_models import HFLike, batch
    from torch.nn.parallel import DistributedDataParallel

    import harness.audit
    from harness.core.microbatch import IGNORE_INDEX

    rank, world = dist.get_rank(), dist.get_world_size()
    windows = [[batch([9, 4], 1 + rank), batch([17, 12, 3][: 1 + 2 * rank], 2 + rank)]]
    with harness.audit.watch(windows=1) as audit:
        model = DistributedDataParallel(HFLike())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for mbs in windows:
            counts = [int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in mbs]
            total = torch.tensor(sum(counts))
            if not wrong:
                dist.all_reduce(total)
            for i, (b, n) in enumerate(zip(mbs, counts)):
                model.require_backward_grad_sync = i == len(mbs) - 1
                (model(**b).loss * n / total * (1 if wrong else world)).backward()
            opt.step()
    verdict = audit.verdict()
    return verdict.passed, str(verdict)


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [False, True])
def test_the_in_code_form_judges_every_rank_together(wrong: bool) -> None:
    """Two ranks started by the harness's launcher, not by the command: each records its own windows, verdict()
    gathers them on rank 0, and both ranks get the same verdict (right: passed; a local count: the reading)."""
    from harness.distributed.launcher import launch

    results = launch(_in_code_rank, 2, wrong, deadline=120.0)
    assert results[0] == results[1], results
    passed, said = results[0]
    assert passed is not wrong, said
    assert "2 rank(s) (DDP)" in said and ("reading (mean_of_local_means)" in said) is wrong
