"""Stop at 50, resume to 100: the same bits as a run that never stopped, and every resume mistake is caught.

Seed 000's r1 workflow on configs/minimum.yaml (100 updates, stop at 50, 2 ranks, 2 microbatches each). All training
happens inside launched ranks; the pytest process only compares the summaries they return and reads files.
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
from support.ports import HOST, free_port, port_taken

from harness.data.config import Config, load_config
from harness.data.corpus import make_corpus, split_rows
from harness.distributed.launcher import Expected, launch
from harness.model import build_model
from harness.resume.checkpoint import MANIFEST, SHARED, latest_checkpoint, rank_file, step_dir_name
from harness.training.evaluation import EVAL_FILE, evaluate_model
from harness.training.trainer import launched_run, state_difference

ROOT = Path(__file__).resolve().parents[2]
MINIMUM = ROOT / "configs" / "minimum.yaml"
DEADLINE = 60.0


# The module's runs (continuous, stopped at 50) are fixtures: one worker computes them once for every test here.
pytestmark = pytest.mark.xdist_group("resume-minimum")


@pytest.fixture(scope="module")
def resume_config() -> Config:
    return load_config(MINIMUM)


@pytest.fixture(scope="module")
def continuous_minimum(resume_config: Config, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The control: one uninterrupted run to step 100, with evaluation at the end."""
    run_dir = tmp_path_factory.mktemp("continuous")
    return run_dir, launch(launched_run, 2, resume_config, str(run_dir), {"evaluate": True}, deadline=DEADLINE)


@pytest.fixture(scope="module")
def stopped_minimum(resume_config: Config, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The planned stop: the same run, stopped after step 50 and its checkpoint."""
    run_dir = tmp_path_factory.mktemp("stopped")
    return run_dir, launch(launched_run, 2, resume_config, str(run_dir), {"stop_at": 50}, deadline=DEADLINE)


def _resume(config: Config, run_dir: Path, step_dir: Path, **options: Any) -> list[Any]:
    return launch(launched_run, 2, config, str(run_dir), {"resume": str(step_dir), **options}, deadline=DEADLINE,
                  expect=(ValueError,))


def _worst(control: list[dict], other: list[dict], what: str = "state") -> float:
    return max(state_difference(a[what], b[what]) for a, b in zip(control, other))


def test_the_stopped_run_ends_with_a_complete_checkpoint_at_step_50(stopped_minimum: tuple) -> None:
    """Stopping at 50 writes step-0050 last; no later step exists and no temporary file is left behind."""
    run_dir, summaries = stopped_minimum
    assert [s["final_step"] for s in summaries] == [50, 50]
    assert latest_checkpoint(run_dir).name == "step-0050"  # type: ignore[union-attr]
    assert [step_dir_name(k) for k in range(10, 51, 10)] == sorted(p.name for p in run_dir.glob("step-*"))
    assert [] == [p.name for p in run_dir.rglob("*.tmp-*")]


def test_resume_at_50_is_bitwise_equal_to_the_continuous_run_at_100_on_every_rank(
    resume_config: Config, continuous_minimum: tuple, stopped_minimum: tuple, tmp_path: Path
) -> None:
    """Model, optimizer (momentum) and scheduler at step 100: max absolute difference exactly 0.0 on each rank."""
    _, control = continuous_minimum
    resumed = _resume(resume_config, tmp_path, stopped_minimum[0] / "step-0050")
    assert [s["start_step"] for s in resumed] == [50, 50]
    for rank in range(2):
        for part in ("model", "optimizer", "scheduler"):
            got = state_difference(control[rank]["state"][part], resumed[rank]["state"][part])
            assert got == 0.0, f"rank {rank}: {part} differs by {got}"
        assert control[rank]["losses"] == resumed[rank]["losses"]
        # Python's and numpy's streams do not shape these numbers, so they are checked by a draw after the last step.
        assert control[rank]["rng_draws"] == resumed[rank]["rng_draws"]
    assert control[0]["rng_draws"] != control[1]["rng_draws"], "ranks must have their own RNG streams"


# The four mistakes the end-of-run comparison of this workflow sees; every one of RESUME_BUGS (Python's and numpy's
# RNG not restored among them, which no end-of-run comparison can see) goes through the resume battery, whose state
# comparison sees each (tests/distributed/test_resume_battery.py).
END_OF_RUN_BUGS = ("reseed", "drop_optimizer", "rank0_rng", "restart_plan")


# One here; the resume battery's controls (tests/distributed/test_resume_battery.py, slow tier) run every one of
# them, with the state that differs named.
@pytest.mark.parametrize("bug", END_OF_RUN_BUGS[:1])
def test_each_resume_mistake_is_caught_by_the_bitwise_check(
    bug: str, resume_config: Config, continuous_minimum: tuple, stopped_minimum: tuple, tmp_path: Path
) -> None:
    """Negative control: re-seeding, dropping momentum, rank 0's RNG everywhere, restarting the plan: step 100 moves."""
    _, control = continuous_minimum
    resumed = _resume(resume_config, tmp_path, stopped_minimum[0] / "step-0050", resume_bug=bug)
    assert _worst(control, resumed) > 0.0


def test_resume_refuses_a_config_change_that_alters_the_trajectory(
    resume_config: Config, stopped_minimum: tuple, tmp_path: Path
) -> None:
    """Every rank refuses a changed learning rate, naming the shared file, the key and both values."""
    results = _resume(resume_config.replace(lr=0.1), tmp_path, stopped_minimum[0] / "step-0050")
    assert all(isinstance(r, Expected) and r.type == "ValueError" for r in results)
    assert "shared.pt: config key 'lr' differs: checkpoint has 0.05, this run has 0.1" in results[0].message


def test_resume_refuses_another_world_size(resume_config: Config, stopped_minimum: tuple, tmp_path: Path) -> None:
    """A two-rank checkpoint does not resume on one rank."""
    step_dir = stopped_minimum[0] / "step-0050"
    (result,) = launch(launched_run, 1, resume_config.replace(world_size=1), str(tmp_path),
                       {"resume": str(step_dir)}, deadline=DEADLINE, expect=(ValueError,))
    assert isinstance(result, Expected)
    assert "written by world size 2, this run has 1" in result.message


def test_resume_refuses_a_corrupted_checkpoint_on_every_rank(
    resume_config: Config, stopped_minimum: tuple, tmp_path: Path
) -> None:
    """A flipped byte in a copy of step-0050's rank file is a checksum mismatch; no rank trains on it."""
    import shutil

    step_dir = tmp_path / "copy" / "step-0050"
    shutil.copytree(stopped_minimum[0] / "step-0050", step_dir)
    data = bytearray((step_dir / rank_file(1)).read_bytes())
    data[len(data) // 2] ^= 0x01
    (step_dir / rank_file(1)).write_bytes(bytes(data))
    results = _resume(resume_config, tmp_path / "resumed", step_dir)
    assert all(isinstance(r, Expected) and "rank-1.pt: checksum mismatch" in r.message for r in results)


def test_evaluation_uses_all_reduced_sums_over_the_256_test_sequences(
    resume_config: Config, continuous_minimum: tuple
) -> None:
    """Every rank reports the same test figures, equal to one process evaluating the final model on the whole split."""
    run_dir, control = continuous_minimum
    assert control[0]["eval"] == control[1]["eval"]
    saved = json.loads((run_dir / EVAL_FILE).read_text())
    assert saved["step"] == 100
    assert saved["test_sequences"] == 256
    rows = make_corpus(resume_config)
    assert sum(r.supervised for r in split_rows(rows, "test")) == saved["test_tokens"]
    # Building a module draws its default initialisation from the global RNG, which this process must not change.
    with torch.random.fork_rng(devices=[]):
        model = build_model(resume_config)
    model.load_state_dict(control[0]["state"]["model"])
    single = evaluate_model(model, rows, resume_config, torch.device("cpu"))
    assert single["test_accuracy"] == saved["test_accuracy"]
    # Same per-token terms, other batch sums in float32: only summation order differs.
    assert saved["test_loss"] == pytest.approx(single["test_loss"], rel=1e-6)


def _torchrun(cwd: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # A port found free can be taken by another process before torchrun binds it: try another one, a few times.
    for _ in range(3):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
            "--rdzv-backend=static", f"--master-addr={HOST}", f"--master-port={free_port()}",
            "-m", "harness.train", "--config", str(MINIMUM), *args,
        ]
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode == 0 or not port_taken(done.stdout + done.stderr):
            break
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.slow
def test_torchrun_stop_and_resume_lands_on_the_continuous_checkpoint(tmp_path: Path) -> None:
    """The real command lines: stop at 50, --continuous, --resume step-0050; step-0100 files carry equal state."""
    runs = {name: tmp_path / name for name in ("stopped", "continuous", "resumed")}
    _torchrun(tmp_path, "--run-dir", str(runs["stopped"]))
    _torchrun(tmp_path, "--run-dir", str(runs["continuous"]), "--continuous")
    _torchrun(tmp_path, "--run-dir", str(runs["resumed"]), "--resume", str(runs["stopped"] / "step-0050"))
    assert not (runs["stopped"] / "step-0060").exists()
    a, b = runs["continuous"] / "step-0100", runs["resumed"] / "step-0100"
    assert (a / MANIFEST).is_file() and (b / MANIFEST).is_file()
    shared_a, shared_b = (torch.load(d / SHARED, weights_only=True) for d in (a, b))
    for part in ("model", "optimizer", "scheduler"):
        assert state_difference(shared_a[part], shared_b[part]) == 0.0, part
    for rank in range(2):
        ra, rb = (torch.load(d / rank_file(rank), weights_only=True) for d in (a, b))
        assert state_difference(ra, rb) == 0.0, f"rank {rank}'s RNG states, position or losses differ"
    evals = [json.loads((runs[name] / EVAL_FILE).read_text()) for name in ("continuous", "resumed")]
    assert evals[0] == evals[1]
