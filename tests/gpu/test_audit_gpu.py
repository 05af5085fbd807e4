"""``gpu`` and ``gpu2``: the audit of an unchanged script whose ranks compute on CUDA (``pytest -m gpu``, ``pytest -m
gpu2``; skipped with their reason where the devices are missing).

* One rank on the GPU over NCCL (tests/scripts/ddp_train.py): the records come back to the CPU through NCCL's
  ``gather_object``, the reference runs in float64 on the CPU; the right script exits 0, the mean per microbatch reads
  ``per_microbatch_mean``.
* Two ranks sharing the one GPU over gloo (NCCL refuses two ranks on one device): a mean of local means reads so.
* nanoGPT's loop with its forward under CUDA bf16 autocast: judged by 4x the noise of the correct computation
  replayed under autocast; the right loop passes, ``loss / gradient_accumulation_steps`` fails.
* ``gpu2``: two ranks on two GPUs over NCCL, right and wrong.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.testing.skips import requires_cuda, requires_two_gpus

SCRIPTS = Path(__file__).parents[1] / "scripts"


def audit(nproc: int, script: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", "audit", "--deadline", "240", "--", sys.executable, "-m",
                           "torch.distributed.run", "--nproc-per-node", str(nproc), str(SCRIPTS / script), *argv],
                          cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("nproc", "script", "argv", "status", "said"), [
    (1, "ddp_train.py", ("--backend", "nccl"), 0, "1 rank(s) (DDP)"),
    (1, "ddp_train.py", ("--backend", "nccl", "--wrong", "accumulation_mean"), 1, "reading (per_microbatch_mean)"),
    (2, "ddp_train.py", ("--backend", "gloo"), 0, "2 rank(s) (DDP)"),
    (2, "ddp_train.py", ("--backend", "gloo", "--wrong", "local_count"), 1, "reading (mean_of_local_means)"),
    (1, "nanogpt_train.py", ("--backend", "nccl"), 0, "under bfloat16 autocast"),
    (1, "nanogpt_train.py", ("--backend", "nccl", "--wrong", "accumulation_mean"), 1, "parity FAILED: relative L2"),
])
def test_a_script_on_one_gpu_is_judged(tmp_path: Path, nproc: int, script: str, argv: tuple[str, ...], status: int,
                                       said: str) -> None:
    done = audit(nproc, script, "--device", "cuda", *argv, cwd=tmp_path)
    assert status == done.returncode, done.stdout + done.stderr
    assert said in done.stdout, done.stdout


@pytest.mark.gpu2
@requires_two_gpus
@pytest.mark.parametrize(("argv", "status"), [((), 0), (("--wrong", "local_count"), 1)])
def test_a_script_on_two_gpus_over_nccl_is_judged(tmp_path: Path, argv: tuple[str, ...], status: int) -> None:
    done = audit(2, "ddp_train.py", "--device", "cuda", "--backend", "nccl", *argv, cwd=tmp_path)
    assert status == done.returncode, done.stdout + done.stderr
    assert "2 rank(s) (DDP)" in done.stdout, done.stdout
