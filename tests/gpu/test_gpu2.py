"""``gpu2``: two ranks, one CUDA device each (``LOCAL_RANK``), NCCL (``pytest -m gpu2``; the gate for training code).

Skipped, with the reason decided at collection, wherever two CUDA devices and NCCL are not both present (a single GPU
is not enough: NCCL refuses two ranks on one device). Checks:

* The battery for ``--recipe`` over pure ``nccl`` (counts all-reduced on CUDA) and over ``cpu:gloo,cuda:nccl``
  (counts on the CPU over gloo, gradients on CUDA over NCCL), and the mean of local means rejected on both.
* Seed 000's workflow through the real command line: ``torchrun ... harness.train`` stopped at 50, continuous, and
  resumed from step-0050, with NCCL; the step-0100 checkpoints carry equal bits.

Deterministic settings where bit equality is claimed (the torchrun workflow): every rank runs with
``torch.use_deterministic_algorithms(True, warn_only=True)`` (set before ``harness.train.main``) and with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in its environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.ports import HOST, free_port

from harness.battery.judge import checks
from harness.distributed.launcher import launch
from harness.resume.checkpoint import MANIFEST, SHARED, rank_file
from harness.testing.skips import requires_two_gpus
from harness.training.evaluation import EVAL_FILE
from harness.training.trainer import state_difference

pytestmark = [pytest.mark.gpu2, requires_two_gpus]

ROOT = Path(__file__).resolve().parents[2]
MINIMUM = ROOT / "configs" / "minimum.yaml"
TORCHRUN_TIMEOUT = 180.0
"""Seconds one torchrun invocation (100 steps on two ranks, two CUDA contexts, NCCL set-up) may take."""

DETERMINISTIC_MAIN = (
    "import sys, torch; torch.use_deterministic_algorithms(True, warn_only=True); "
    "from harness.training.torchrun import entry; entry(sys.argv[1:])"
)
"""What each torchrun worker runs: ``harness.train``'s command line with deterministic algorithms switched on first."""


@pytest.fixture(params=("nccl", "cpu:gloo,cuda:nccl"), ids=("nccl", "cpu-gloo-cuda-nccl"))
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def rank_device() -> tuple[int, str]:
    """Rank body: the CUDA device this rank computes on, and its ``LOCAL_RANK``."""
    return torch.cuda.current_device(), os.environ["LOCAL_RANK"]


# ------------------------------------------------------------------------------------------------------ battery


def test_each_rank_computes_on_its_own_device() -> None:
    """Rank r is on CUDA device r, the device its LOCAL_RANK names: never two ranks on one device."""
    assert [(0, "0"), (1, "1")] == launch(rank_device, 2, backend="nccl", device="cuda", deadline=60)


@pytest.mark.parametrize("scenario", ("uneven", "varying", "one_empty"))
def test_two_ranks_on_two_devices_match_the_reference(
    recipe_path: str, backend: str, scenario: str, cuda_battery: Any, battery_check: Any
) -> None:
    """Gradients reduced by NCCL equal the single-device reference within the seed's float32 tolerances."""
    battery_check(checks.parity(cuda_battery(recipe_path, scenario, backend)))


def test_two_ranks_on_two_devices_synchronize_once_per_window(
    recipe_path: str, backend: str, cuda_battery: Any, battery_check: Any
) -> None:
    """One synchronizing backward per window: no_sync holds under NCCL as under gloo."""
    battery_check(checks.one_sync(cuda_battery(recipe_path, "varying", backend)))


def test_two_ranks_on_two_devices_hold_identical_parameters_after_every_step(
    recipe_path: str, backend: str, cuda_battery: Any, battery_check: Any
) -> None:
    """NCCL hands both ranks the same reduced gradient: bitwise equal parameters after each step."""
    battery_check(checks.ranks_agree(cuda_battery(recipe_path, "varying", backend)))


def test_a_window_without_supervised_tokens_is_refused_on_both_devices(
    recipe_path: str, backend: str, cuda_battery: Any, battery_check: Any
) -> None:
    """No supervised token anywhere: both ranks raise ValueError after the count, neither waits in NCCL."""
    battery_check(checks.empty_window(cuda_battery(recipe_path, "all_empty", backend)))


def test_the_mean_of_local_means_is_rejected_on_two_devices(backend: str, cuda_battery: Any) -> None:
    """Negative control: on uneven ranks the mean of local means misses the reference by at least 100 tolerances."""
    verdict = checks.parity(cuda_battery("harness.recipes:mean_of_local_means", "uneven", backend))
    assert not verdict.passed, verdict.message
    assert verdict.worst_ratio is not None and verdict.worst_ratio >= 100, verdict.message


# ------------------------------------------------------------------------------------- seed 000 through torchrun


def torchrun(cwd: Path, env: dict[str, str], *args: str, backend: str = "nccl") -> None:
    """``torchrun --nproc-per-node=2`` of ``harness.train`` (deterministic) with ``args``; fails with its output."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=static",
        f"--master-addr={HOST}", f"--master-port={free_port()}", "--no-python", sys.executable, "-c",
        DETERMINISTIC_MAIN, "--config", str(MINIMUM), "--backend", backend, *args,
    ]
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def seed_000_workflow(root: Path, env: dict[str, str], backend: str = "nccl") -> dict[str, Path]:
    """Stop at 50, run continuously to 100, resume step-0050 to 100: seed 000's r1 workflow, three command lines."""
    root.mkdir(parents=True, exist_ok=True)
    runs = {name: root / name for name in ("stopped", "continuous", "resumed")}
    torchrun(root, env, "--run-dir", str(runs["stopped"]), backend=backend)
    torchrun(root, env, "--run-dir", str(runs["continuous"]), "--continuous", backend=backend)
    torchrun(root, env, "--run-dir", str(runs["resumed"]), "--resume", str(runs["stopped"] / "step-0050"),
             backend=backend)
    return runs


def step_100_differences(runs: dict[str, Path]) -> dict[str, float]:
    """Largest absolute difference per file part between the continuous and resumed step-0100 (0.0: equal bits)."""
    a, b = runs["continuous"] / "step-0100", runs["resumed"] / "step-0100"
    shared_a, shared_b = (torch.load(d / SHARED, weights_only=True) for d in (a, b))
    out = {part: state_difference(shared_a[part], shared_b[part]) for part in ("model", "optimizer", "scheduler")}
    for rank in range(2):
        ra, rb = (torch.load(d / rank_file(rank), weights_only=True) for d in (a, b))
        out[f"rank {rank} state"] = state_difference(ra, rb)
    return out


def test_seed_000_stop_and_resume_through_torchrun_with_nccl_is_bitwise_equal_at_step_100(
    tmp_path: Path, deterministic_env: dict[str, str]
) -> None:
    """torchrun with NCCL: the resumed step-0100 equals the continuous one bit for bit, on each rank's CUDA device."""
    runs = seed_000_workflow(tmp_path, deterministic_env)
    assert not (runs["stopped"] / "step-0060").exists()
    step_100 = runs["continuous"] / "step-0100"
    assert (step_100 / MANIFEST).is_file() and (runs["resumed"] / "step-0100" / MANIFEST).is_file()
    for rank in range(2):
        # Each rank trained on its device: its rank file holds that device's generator state.
        assert torch.load(step_100 / rank_file(rank), weights_only=True)["rng"]["cuda"] is not None
    differences = step_100_differences(runs)
    assert all(d == 0.0 for d in differences.values()), f"step-0100 differs: {differences}"
    evals = [json.loads((runs[name] / EVAL_FILE).read_text()) for name in ("continuous", "resumed")]
    assert evals[0] == evals[1]


# ------------------------------------------------------------------------------------------- battery under torchrun


def test_the_battery_under_torchrun_on_two_gpus_with_nccl(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node=2 -m harness.battery.dist``: one rank per device, NCCL (the default when every local
    rank has its own GPU); the correct recipe passes every check, the mean of local means fails parity."""
    from support.battery_jobs import job

    codes, text, report = job(tmp_path, "--recipe", "harness.recipes:global_token_mean", "--precision", "fp32",
                              nodes=1, per_node=2)
    assert [0] == codes, text[-3000:]
    assert report is not None and "battery: harness.recipes:global_token_mean at W=2 (nccl)" in text
    codes, text, report = job(tmp_path, "--recipe", "harness.recipes:mean_of_local_means", "--precision", "fp32",
                              "--scenarios", "uneven", nodes=1, per_node=2)
    assert [1] == codes and report is not None, text[-3000:]
    assert "mean_of_local_means" == next(c for c in report["checks"] if c["check"] == "parity")["diagnosis"][
        "signature"]
