"""``gpu``: what one CUDA device can prove (``pytest -m gpu``; skipped with its reason where there is none).

* The single-device reference computed by CUDA kernels in float32 equals the CPU float64 reference within seed 000's
  float32 tolerances (atol 1e-6, rtol 1e-4): CUDA sums in other orders, and nothing else may differ.
* Two ranks sharing the one device, over gloo with CUDA tensors (NCCL refuses two ranks on one device): the battery's
  parity, synchronization count, rank agreement and empty-window checks for ``--recipe``, and the mean of local means
  rejected there, so the lane is shown able to fail.
* Resume on CUDA kernels: stop at 50, resume, and land on the continuous run's bits at 100, with the CUDA generator's
  state restored (dropout draws from it): on one rank over ``cpu:gloo,cuda:nccl``, and with seed 000's two ranks
  sharing the device over gloo (``device_choice="cuda"``; NCCL will not put two ranks on one device).

Deterministic settings where bit equality is claimed (the resume tests; the gradient checks use tolerances instead):
every rank runs with ``torch.use_deterministic_algorithms(True, warn_only=True)`` and with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in its environment. ``warn_only``: an operation without a deterministic CUDA
kernel warns instead of raising; each rank reports those warnings, the bitwise comparison decides, and a failure
names them.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.battery import scenarios
from harness.battery.judge import checks
from harness.core.compare import FLOAT32_TOLERANCE, compare
from harness.core.reference import Reference, reference_gradient
from harness.data.config import Config
from harness.distributed.launcher import launch
from harness.model import build_model
from harness.resume.checkpoint import rank_file
from harness.testing.skips import requires_cuda, requires_one_gpu_with_nccl
from harness.training.trainer import launched_run, state_difference

pytestmark = [pytest.mark.gpu, requires_cuda]

CUDA_TRAINING_BACKEND = "cpu:gloo,cuda:nccl"
"""Counts on the CPU over gloo, gradients on CUDA over NCCL: the trainer picks CUDA only when NCCL is in the backend."""

TRAIN_DEADLINE = 180.0
"""Seconds one training launch (up to 100 steps on one rank) may take."""


# --------------------------------------------------------------------------------------- helpers (device-agnostic)


def reference_on(window: list[list[Any]], device: str, dtype: torch.dtype) -> Reference:
    """The single-device reference of one window, computed on ``device`` in ``dtype`` from the battery's weights."""
    model = build_model(scenarios.BATTERY_CONFIG).to(dtype).to(device)
    return reference_gradient(model, window)


def deterministic_launched_run(config: Config, run_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    """Rank body: the trainer's ``launched_run`` with deterministic algorithms; names any op that has none."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = launched_run(config, run_dir, options)
    summary["nondeterministic"] = sorted(
        {str(w.message).splitlines()[0] for w in caught if "deterministic" in str(w.message)}
    )
    return summary


def train(config: Config, run_dir: Path, options: dict[str, Any], env: dict[str, str], *, device: str = "cuda",
          backend: str = CUDA_TRAINING_BACKEND) -> dict[str, Any]:
    """One launch of ``config.world_size`` ranks through the trainer; returns rank 0's summary."""
    summaries = launch(deterministic_launched_run, config.world_size, config, str(run_dir), options,
                       deadline=TRAIN_DEADLINE, backend=backend, device=device, env=env)
    return dict(summaries[0])


def assert_bitwise_equal(control: dict[str, Any], resumed: dict[str, Any]) -> None:
    """Every part of the final state equal to the bit; a failure names the ops that had no deterministic kernel."""
    differences = bitwise_differences(control, resumed)
    unsure = sorted(set(control["nondeterministic"]) | set(resumed["nondeterministic"]))
    assert all(d == 0.0 for d in differences.values()), f"differences {differences}; nondeterministic ops: {unsure}"


def bitwise_differences(control: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """Largest absolute difference per part of the final state (0.0: equal bits)."""
    parts = {part: state_difference(control["state"][part], other["state"][part])
             for part in ("model", "optimizer", "scheduler")}
    parts["losses"] = state_difference(control["losses"], other["losses"])
    parts["rng_draws"] = state_difference(list(control["rng_draws"]), list(other["rng_draws"]))
    return parts


# ----------------------------------------------------------------------------------- the reference on CUDA kernels


@pytest.mark.parametrize("scenario", ("uneven", "varying"))
def test_the_cuda_float32_reference_equals_the_cpu_float64_reference_within_seed_tolerances(scenario: str) -> None:
    """Each window's single-device gradient from CUDA kernels in float32 is within atol 1e-6, rtol 1e-4 of float64's."""
    atol, rtol = FLOAT32_TOLERANCE
    for k, window in enumerate(scenarios.build(scenario, 2)):
        got = reference_on(window, "cuda", torch.float32)
        want = reference_on(window, "cpu", torch.float64)
        assert want.tokens == got.tokens
        # Same terms, summed by other kernels in another order and in float32: the seed's float32 tolerance.
        result = compare(got.gradient, want.gradient, atol=atol, rtol=rtol)
        matmul = torch.get_float32_matmul_precision()
        assert result.passed, f"window {k}: {result.summary()} (float32 matmul precision {matmul!r}; TF32 breaks this)"
        assert abs(got.loss - want.loss) <= atol + rtol * abs(want.loss), f"window {k}: {got.loss!r} vs {want.loss!r}"


# ------------------------------------------------------------------------- two ranks sharing the device over gloo


@pytest.mark.parametrize("scenario", ("uneven", "varying", "one_empty"))
def test_two_ranks_sharing_the_device_over_gloo_match_the_reference(
    recipe_path: str, scenario: str, cuda_battery: Any, battery_check: Any
) -> None:
    """CUDA tensors reduced by gloo: each rank's synchronized gradient equals the single-device reference."""
    battery_check(checks.parity(cuda_battery(recipe_path, scenario, "gloo")))


def test_two_ranks_sharing_the_device_synchronize_once_per_window(
    recipe_path: str, cuda_battery: Any, battery_check: Any
) -> None:
    """The counting hook sees one synchronizing backward per window on CUDA as on the CPU."""
    battery_check(checks.one_sync(cuda_battery(recipe_path, "varying", "gloo")))


def test_two_ranks_sharing_the_device_hold_identical_parameters_after_every_step(
    recipe_path: str, cuda_battery: Any, battery_check: Any
) -> None:
    """Both ranks apply the same all-reduced gradient: bitwise equal parameters after each SGD step."""
    battery_check(checks.ranks_agree(cuda_battery(recipe_path, "varying", "gloo")))


def test_a_window_without_supervised_tokens_is_refused_by_both_ranks_on_the_device(
    recipe_path: str, cuda_battery: Any, battery_check: Any
) -> None:
    """No supervised token anywhere: both ranks raise ValueError, neither hangs, no weight changes."""
    battery_check(checks.empty_window(cuda_battery(recipe_path, "all_empty", "gloo")))


def test_the_mean_of_local_means_is_rejected_by_two_ranks_sharing_the_device(cuda_battery: Any) -> None:
    """Negative control: on uneven ranks the mean of local means misses the reference by at least 100 tolerances."""
    verdict = checks.parity(cuda_battery("harness.recipes:mean_of_local_means", "uneven", "gloo"))
    assert not verdict.passed, verdict.message
    assert verdict.worst_ratio is not None and verdict.worst_ratio >= 100, verdict.message


# ---------------------------------------------------------------------------------------------- resume on CUDA


@pytest.fixture(scope="module")
def cuda_config() -> Config:
    """Seed 000's minimum config (its defaults, so no YAML is read) on one rank."""
    return Config().replace(world_size=1)


@pytest.fixture(scope="module")
def continuous_on_cuda(
    cuda_config: Config, deterministic_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("cuda-continuous")
    return run_dir, train(cuda_config, run_dir, {}, deterministic_env)


@pytest.fixture(scope="module")
def stopped_on_cuda(
    cuda_config: Config, deterministic_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    run_dir = tmp_path_factory.mktemp("cuda-stopped")
    train(cuda_config, run_dir, {"stop_at": 50}, deterministic_env)
    return run_dir


@requires_one_gpu_with_nccl
def test_resume_at_50_on_cuda_is_bitwise_equal_to_the_continuous_run_at_100(
    cuda_config: Config, continuous_on_cuda: tuple, stopped_on_cuda: Path, deterministic_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """Model, momentum, schedule, losses and RNG draws at step 100: exactly equal, with CUDA's generator restored."""
    run_dir, control = continuous_on_cuda
    # The trainer really ran on the device: its rank file holds the CUDA generator's state.
    assert torch.load(run_dir / "step-0100" / rank_file(0), weights_only=True)["rng"]["cuda"] is not None
    resumed = train(cuda_config, tmp_path, {"resume": str(stopped_on_cuda / "step-0050")}, deterministic_env)
    assert 50 == resumed["start_step"]
    assert_bitwise_equal(control, resumed)


@requires_one_gpu_with_nccl
def test_a_resume_that_reseeds_the_generators_is_caught_on_cuda(
    cuda_config: Config, continuous_on_cuda: tuple, stopped_on_cuda: Path, deterministic_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """Negative control: re-seeding instead of restoring changes CUDA's dropout masks, and step 100 moves."""
    _, control = continuous_on_cuda
    options = {"resume": str(stopped_on_cuda / "step-0050"), "resume_bug": "reseed"}
    resumed = train(cuda_config, tmp_path, options, deterministic_env)
    assert bitwise_differences(control, resumed)["model"] > 0.0


# ------------------------------------------------------------- resume with two ranks sharing the device over gloo


@pytest.fixture(scope="module")
def shared_device_config() -> Config:
    """Seed 000's minimum config at its own world size, 2: both ranks on the one device, gloo between them."""
    return Config()


def _train_shared(config: Config, run_dir: Path, options: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    return train(config, run_dir, {**options, "device_choice": "cuda"}, env, backend="gloo")


def test_two_ranks_sharing_the_device_resume_at_50_bitwise_equal_to_the_continuous_run(
    shared_device_config: Config, deterministic_env: dict[str, str], tmp_path: Path
) -> None:
    """Seed 000's W=2 trio on CUDA kernels over gloo: stop at 50, resume, and land on the continuous run's bits."""
    control = _train_shared(shared_device_config, tmp_path / "continuous", {}, deterministic_env)
    _train_shared(shared_device_config, tmp_path / "stopped", {"stop_at": 50}, deterministic_env)
    assert torch.load(tmp_path / "stopped" / "step-0050" / rank_file(1), weights_only=True)["rng"]["cuda"] is not None
    resumed = _train_shared(shared_device_config, tmp_path / "resumed",
                            {"resume": str(tmp_path / "stopped" / "step-0050")}, deterministic_env)
    assert_bitwise_equal(control, resumed)
    # Negative control on the same device: restoring rank 0's generators on every rank moves step 100.
    wrong = _train_shared(shared_device_config, tmp_path / "rank0-rng",
                          {"resume": str(tmp_path / "stopped" / "step-0050"), "resume_bug": "rank0_rng"},
                          deterministic_env)
    assert bitwise_differences(control, wrong)["model"] > 0.0


@requires_one_gpu_with_nccl
def test_the_battery_under_torchrun_with_one_nccl_worker(tmp_path: Path) -> None:
    """One GPU: ``torchrun --nproc-per-node=1 -m harness.battery.dist`` on NCCL; the W=1 lane passes (the checks that
    mean nothing at one rank are n/a)."""
    from support.battery_jobs import job

    codes, text, report = job(tmp_path, "--recipe", "harness.recipes:global_token_mean", "--precision", "fp32",
                              nodes=1, per_node=1)
    assert [0] == codes, text[-3000:]
    assert report is not None and "(nccl)" in text and 0 == report["counts"]["fail"]
