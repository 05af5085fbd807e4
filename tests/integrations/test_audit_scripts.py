"""``python -m harness audit`` on scripts written against the libraries, not one line changed, under torchrun with two
gloo ranks, each a Llama from a config with a padding collator and two microbatches of accumulation:

- a transformers ``Trainer`` script (tests/scripts/trainer_train.py): as its documentation writes it, it exits 0;
  ``average_tokens_across_devices=False`` exits 1 with the mean-of-local-means reading and its fix;
- an accelerate ``accumulate`` script (tests/scripts/accelerate_train.py): the loss sum over the gathered token count
  exits 0; ``backward(out.loss)`` as the guide shows exits 1 with the per-microbatch-mean reading; launched by
  ``accelerate launch --multi_gpu`` (its torchrun launcher; the script asks for the CPU) instead of torchrun, the
  same.

The Trainer's clip is watched: with ``max_grad_norm=0.05`` it engages, the reference is clipped alike and the norm it
returned is judged. With ``--unbalance`` the Trainer's own ``num_items_in_batch`` is counted from the masked batches:
the right script still passes, the local average still fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the integrations lane: bash scripts/integrations.sh")

pytestmark = pytest.mark.integrations

SCRIPTS = Path(__file__).parents[1] / "scripts"


@pytest.mark.parametrize(("script", "extra", "status", "said"), [
    ("trainer_train.py", (), 0, "every audited window's gradient is the reference's"),
    ("trainer_train.py", ("--local-average",), 1, "reading (mean_of_local_means)"),
    ("accelerate_train.py", (), 0, "every audited window's gradient is the reference's"),
    ("accelerate_train.py", ("--as-documented",), 1, "reading (per_microbatch_mean)"),
])
def test_a_library_script_is_judged_as_it_runs(tmp_path: Path, script: str, extra: tuple[str, ...], status: int,
                                               said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "harness", "audit", "--", sys.executable, "-m",
                           "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPTS / script), *extra],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert status == done.returncode, done.stdout + done.stderr
    assert said in done.stdout, done.stdout
    assert 4 == done.stdout.count("parity "), done.stdout


def audit(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", "audit", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2")


def test_the_trainers_clip_is_judged_where_it_engages(tmp_path: Path) -> None:
    done = audit("--", *TORCHRUN, str(SCRIPTS / "trainer_train.py"), "--max-grad-norm", "0.05", cwd=tmp_path)
    assert 0 == done.returncode, done.stdout + done.stderr
    assert 4 == done.stdout.count("clipping PASSED") and "(max_norm 0.05, engaged)" in done.stdout, done.stdout


@pytest.mark.parametrize(("extra", "status"), [((), 0), (("--local-average",), 1)])
def test_unbalance_keeps_the_trainers_own_count_right(tmp_path: Path, extra: tuple[str, ...], status: int) -> None:
    done = audit("--unbalance", "--", *TORCHRUN, str(SCRIPTS / "trainer_train.py"), *extra, cwd=tmp_path)
    assert status == done.returncode, done.stdout + done.stderr
    assert "note: --unbalance: each row of the" in done.stdout, done.stdout


def test_accelerate_launch_is_a_launcher_the_audit_takes(tmp_path: Path) -> None:
    launch = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no")
    right = audit("--", *launch, str(SCRIPTS / "accelerate_train.py"), cwd=tmp_path)
    assert 0 == right.returncode and "2 rank(s) (DDP)" in right.stdout, right.stdout + right.stderr
    wrong = audit("--", *launch, str(SCRIPTS / "accelerate_train.py"), "--as-documented", cwd=tmp_path)
    assert 1 == wrong.returncode and "reading (per_microbatch_mean)" in wrong.stdout, wrong.stdout
