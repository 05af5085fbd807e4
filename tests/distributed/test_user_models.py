"""The battery on a user's model (``--model``) and in the Hugging Face batch convention (``--batch-format=hf``).

The model is ``tests/user_recipes/models.py``'s causal convolution language model: not a transformer, an output
object with ``.logits``, an attention mask, dropout the battery must disable. The correct recipe passes parity and one
synchronization per window on it in both formats; the mean of local means fails parity in both; the two hf mistakes
(shifting twice, not shifting) fail parity; the recipe helpers' guard refuses a globally empty window on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from user_recipes.guards import guarded_window

from harness.battery.judge import checks, registry
from harness.battery.launch import runner
from harness.battery.plan import cases as plan
from harness.battery.plan.options import BatteryOptions
from harness.battery.report.table import run_cases, run_controls
from harness.distributed.launcher import Expected, launch

ROOT = Path(__file__).parents[2]
MODEL = "user_recipes.models:make_model"
CORRECT = {"harness": "harness.recipes:global_token_mean", "hf": "harness.recipes:hf_global_token_mean"}
FORMATS = ("harness", "hf")


@pytest.mark.parametrize("batch_format", FORMATS)
@pytest.mark.parametrize("world_size", (2, pytest.param(3, marks=pytest.mark.slow)), ids=lambda w: f"world{w}")
def test_the_correct_recipe_passes_parity_and_one_sync_on_a_user_model(batch_format: str, world_size: int) -> None:
    """Identical initial weights on every rank and in the reference, dropout off: the gradient matches in float32
    and float64, with one synchronization per window."""
    for precision in ("fp32", "fp64"):
        run = runner.run(CORRECT[batch_format], "uneven", world_size, precision, model=MODEL, batch_format=batch_format)
        for check in ("parity", "one_sync", "logged_loss"):
            verdict = registry.CHECKS[check](run)
            assert verdict.passed, verdict.message


@pytest.mark.parametrize("batch_format", FORMATS)
def test_the_mean_of_local_means_fails_parity_on_a_user_model(batch_format: str) -> None:
    """The control's mistake shows on the user's model and batches as on the built-in ones: its numbers miss."""
    run = runner.run("harness.recipes:mean_of_local_means", "uneven", 2, model=MODEL, batch_format=batch_format)
    parity = checks.parity(run)
    assert "fail" == parity.status and "numbers" == parity.cause, parity.message
    assert "model user_recipes.models:make_model" in parity.message
    assert checks.one_sync(run).passed


@pytest.mark.parametrize("name", ["hf_shift_twice", "hf_no_shift"])
def test_a_recipe_that_shifts_twice_or_not_at_all_fails_parity(name: str) -> None:
    """On the built-in model (its control target) and on the user's model: another objective, not rounding."""
    (result,) = run_controls([name], BatteryOptions(world_sizes=(2,)))
    assert result.rejected, result.verdict.message
    run = runner.run(f"harness.recipes:{name}", "uneven", 2, model=MODEL, batch_format="hf")
    assert "numbers" == checks.parity(run).cause


def test_the_hf_recipe_passes_every_case_in_the_hf_format() -> None:
    """hf_global_token_mean on every check and scenario at W=2 (float32), on the built-in model."""
    verdicts = run_cases(CORRECT["hf"], plan.cases([2], "fp32"), BatteryOptions(batch_format="hf"))
    assert [] == [v.message for v in verdicts if not v.passed]


@pytest.mark.slow
def test_the_default_correct_recipe_passes_in_either_format_on_the_user_model() -> None:
    """global_token_mean reads the window it gets (Microbatch or hf dict): every case at W=2, float32."""
    verdicts = run_cases(CORRECT["harness"], plan.cases([2], "fp32"), BatteryOptions(model=MODEL, batch_format="hf"))
    assert [] == [v.message for v in verdicts if not v.passed]


def test_a_factory_that_draws_other_weights_per_process_is_reported() -> None:
    """Gradients at different weights prove nothing: the run fails naming the factory and the fix."""
    run = runner.run(CORRECT["harness"], "uneven", 2, model="user_recipes.models:draws_its_own_weights")
    assert run.failure is not None
    assert "built other initial weights than the reference" in str(run.failure)
    assert not checks.parity(run).passed


def test_the_guard_on_the_global_count_raises_on_every_rank_and_hangs_none() -> None:
    """require_tokens(global_count(local)): a window empty on every rank raises the same ValueError on each; a window
    empty on rank 0 only raises nowhere (every rank sees the global count)."""
    results = launch(guarded_window, 2, [0, 0], expect=(ValueError,), deadline=30, lockstep_grace=2.0)
    assert all(isinstance(r, Expected) and r.type == "ValueError" for r in results), results
    assert 1 == len({r.message for r in results})
    assert "no supervised token in the global accumulation window" in results[0].message
    assert [5, 5] == launch(guarded_window, 2, [0, 5], expect=(ValueError,), deadline=30, lockstep_grace=2.0)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})


@pytest.mark.slow
def test_a_bad_model_option_is_a_usage_error_naming_it() -> None:
    """pytest exit 4 and the command line's exit 2, both naming --model, the value and the fix, before any rank."""
    done = _run("-m", "pytest", "-p", "no:cacheprovider", "-m", "recipe", "--model=user_recipes.models:missing",
                "harness/battery", "-q")
    assert 4 == done.returncode, done.stdout + done.stderr
    assert "--model: model='user_recipes.models:missing'" in done.stderr
    assert "zero-argument callable that returns a torch.nn.Module" in done.stderr
    done = _run("-m", "harness", "battery", "--model", "user_recipes.models:returns_a_string")
    assert 2 == done.returncode, done.stdout + done.stderr
    assert "--model: model='user_recipes.models:returns_a_string' returned a str" in done.stderr


def test_a_model_without_logits_is_refused_before_any_rank_starts() -> None:
    """A forward pass on one battery microbatch, in the parent: an output without logits is a usage error naming
    --model and what the harness reads logits from, in both lanes and both batch formats."""
    from harness.battery.prepare.probe.facts import probe
    from harness.model import ModelError

    for fmt in ("harness", "hf"):
        with pytest.raises(ModelError, match=r"model='user_recipes.models:HiddenStatesOnly': .* returned dict"):
            probe("user_recipes.models:HiddenStatesOnly", fmt)
    probe(MODEL, "hf")  # a model the harness can read passes
    done = _run("-m", "harness", "explain", "--recipe", "harness.recipes:global_token_mean", "--model",
                "user_recipes.models:HiddenStatesOnly", "--batch-format", "hf")
    assert 2 == done.returncode, done.stdout + done.stderr
    assert "--model: model='user_recipes.models:HiddenStatesOnly': model(input_ids=..., attention_mask=...)" in (
        done.stderr)
    assert "an object with .logits" in done.stderr


@pytest.mark.slow
def test_both_lanes_take_the_model_and_the_batch_format(tmp_path: Path) -> None:
    """pytest and the command line judge the hf recipe on the user's model (W=2, float32, the uneven scenario) with
    the same verdicts; the reports name the model and the batch format, and hold the same keys."""
    options = ("--model", MODEL, "--batch-format", "hf", "--precision", "fp32")
    via_pytest, via_cli = tmp_path / "pytest.json", tmp_path / "cli.json"
    done = _run("-m", "pytest", "-p", "no:cacheprovider", "-q", "harness/battery/test_battery.py", "-m", "recipe",
                f"--recipe={CORRECT['hf']}", f"--battery-report={via_pytest}", "--battery-world-sizes=2",
                *options, "-k", "uneven")
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-2000:]
    done = _run("-m", "harness", "battery", "--recipe", CORRECT["hf"], "--battery-world-sizes", "2",
                "--battery-examples", "0", "--battery-report", str(via_cli), *options)
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-2000:]
    reports = [json.loads(p.read_text()) for p in (via_pytest, via_cli)]
    for data in reports:
        assert (MODEL, "hf") == (data["model"], data["batch_format"])
    # The clipping check does not apply to a recipe that does not clip (decided before any rank starts).
    uneven = [{(c["check"], c["world_size"]): c["status"] for c in d["checks"]
               if c["scenario"] == "uneven" and c["check"] != "clipping"} for d in reports]
    assert uneven[0] == uneven[1] and set(uneven[0].values()) == {"pass"}
    # One writer, one schema: the same keys at the top and in every verdict, whichever surface wrote the report.
    assert set(reports[0]) == set(reports[1])
    assert {frozenset(c) for c in reports[0]["checks"]} == {frozenset(c) for c in reports[1]["checks"]}
    assert [2] == reports[0]["world_sizes"] == reports[1]["world_sizes"]


WRONG_BACKWARD = "user_recipes.backward_models:wrong_attention"


@pytest.mark.slow
def test_a_model_with_a_wrong_custom_backward_is_refused_on_every_surface_and_its_right_twin_passes() -> None:
    """pytest --recipe (exit 4), python -m harness battery (exit 2) and the torchrun entry (exit 2, before the worker
    joins any group) each say the model's backward is not the gradient of its forward, naming the model, the module
    and the Function; the same model with the right backward passes the command line's battery."""
    said = "model='user_recipes.backward_models:wrong_attention': the model's backward is not the gradient"
    done = _run("-m", "pytest", "-p", "no:cacheprovider", "-q", "harness/battery/test_battery.py", "-m", "recipe",
                f"--recipe={CORRECT['harness']}", f"--model={WRONG_BACKWARD}", "--battery-world-sizes=2")
    assert 4 == done.returncode, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"--model: {said}" in done.stderr and "module attn (FusedAttention)" in done.stderr
    done = _run("-m", "harness", "battery", "--recipe", CORRECT["harness"], "--model", WRONG_BACKWARD)
    assert 2 == done.returncode, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"--model: {said}" in done.stderr and "_AttentionFn" in done.stderr
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "harness.battery.dist", "--recipe", CORRECT["harness"], "--model",
                           WRONG_BACKWARD], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env, "PYTHONPATH": path})
    assert 2 == done.returncode, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"bad input: {said}" in done.stderr
    done = _run("-m", "harness", "battery", "--recipe", CORRECT["harness"], "--model",
                "user_recipes.backward_models:right_attention", "--battery-world-sizes", "2", "--precision", "fp32",
                "--battery-examples", "0")
    assert 0 == done.returncode, done.stdout[-2000:] + done.stderr[-2000:]
