"""Every negative control is diagnosed with its own signature on real ranks, failing verdicts carry the diagnosis
in one line (message, table, JSON), and ``python -m harness explain`` prints and writes it.

Each control is read on its target scenario (where its mistake shows) at W=2 and W=3; the controls whose target is
the uneven window are the issue's "uneven at W=2 and W=3". A control whose mistake is not in the gradient (a sync
count, the random generators, the logged loss) must be diagnosed as a right weighting: the diagnosis never blames
the weights for what the other checks catch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.battery import checks, runner
from harness.battery.diagnose import diagnose
from harness.battery.table import format_table, report_json
from harness.recipes import CONTROLS
from harness.workflow.cli import main

EXPECTED: dict[str, tuple[str | None, str]] = {
    # control: (signature, a phrase its sentence must hold); None: the run leaves no gradient to read.
    "mean_of_local_means": ("mean_of_local_means", "mean of local means"),
    "extra_microbatch_division": ("global_scale", "microbatch count k=5"),
    "no_world_size_factor": ("global_scale", "world-size factor is missing"),
    "per_microbatch_mean": ("per_microbatch_mean", "a mean per microbatch"),
    "skip_backward_when_empty": (None, ""),
    "local_count_guard": (None, ""),
    "never_no_sync": ("correct", "weighting is right"),
    "float32_loss": ("float32_computation", "float32"),
    "local_logged_loss": ("correct", "weighting is right"),
    "two_microbatch_loop": ("dropped", "microbatch 2 "),
    "sync_keyed_to_first_microbatch": ("correct", "weighting is right"),
    "count_from_one_microbatch": ("global_scale", "normalized by"),
    "cached_count": ("global_scale", "window 0's global count"),
    "fixed_accumulation_steps": ("dropped", "microbatch 4 contributed nothing"),
    "first_microbatch_never_syncs": ("not_synchronized", "never synchronized"),
    "nan_on_empty_rank": ("nonfinite", "NaN"),
    "nan_on_empty_microbatch": ("nonfinite", "NaN"),
    "silent_empty_window": (None, ""),
    "nan_gradients_then_raise": (None, ""),
    "python_random_shuffle": ("correct", "weighting is right"),
    "numpy_random_draw": ("correct", "weighting is right"),
    "torch_random_draw": ("correct", "weighting is right"),
    "hf_shift_twice": ("unexplained", "parameter tensors are off"),
    "hf_no_shift": ("unexplained", "parameter tensors are off"),
}


def _run(name: str, world_size: int) -> runner.Run:
    t = CONTROLS[name]
    extra = {"batch_format": t.batch_format} if getattr(t, "batch_format", "harness") != "harness" else {}
    return runner.run(f"harness.recipes:{name}", t.scenario, world_size, t.precision, **extra)  # type: ignore[arg-type]


def test_every_control_has_an_expected_diagnosis() -> None:
    assert sorted(CONTROLS) == sorted(EXPECTED)


@pytest.mark.parametrize("world_size", (2, 3), ids=lambda w: f"world{w}")
@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_control_is_diagnosed_with_its_own_signature(name: str, world_size: int) -> None:
    if name not in CONTROLS:
        pytest.fail(f"{name} is expected but not a control any more")
    if "hf" in name and "batch_format" not in runner.run.__kwdefaults__:  # type: ignore[operator]
        pytest.skip("this checkout's runner has no batch formats")
    signature, phrase = EXPECTED[name]
    found = diagnose(_run(name, world_size))
    if signature is None:
        assert found is None, found.line() if found else ""
        return
    assert found is not None, f"{name}: no gradient to diagnose"
    assert signature == found.signature.name, found.line()
    assert phrase in found.line(), found.line()


def test_the_correct_recipe_weighs_every_token_1_over_n_within_1e_5() -> None:
    """The fp32 bound the catalog calls right; measured here 5e-8 to 7e-8."""
    for world in (2, 3):
        found = diagnose(runner.run("harness.recipes:global_token_mean", "long", world))
        assert found is not None and found.right, found.line() if found else None
        assert max(abs(q - 1) for q in found.ratios()) <= 1e-5


def test_a_failing_parity_verdict_carries_the_diagnosis_in_its_message_table_and_json() -> None:
    verdict = checks.parity(runner.run("harness.recipes:per_microbatch_mean", "uneven", 3))
    assert not verdict.passed
    assert "diagnosis (per_microbatch_mean): " in verdict.message
    assert verdict.diagnosis is not None and "per_microbatch_mean" == verdict.diagnosis["signature"]
    weights = verdict.diagnosis["weights"]
    assert isinstance(weights, list) and 6 == len(weights)
    assert "note: per_microbatch_mean, parity (uneven, W=3, fp32): diagnosis (per_microbatch_mean)" in format_table(
        [verdict])
    report = json.loads(json.dumps(report_json(["harness.recipes:per_microbatch_mean"], [verdict], 1, 1)))
    assert "per_microbatch_mean" == report["checks"][0]["diagnosis"]["signature"]


def test_a_passing_parity_verdict_carries_none() -> None:
    verdict = checks.parity(runner.run("harness.recipes:global_token_mean", "uneven", 3))
    assert verdict.passed and verdict.diagnosis is None


def _explain(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command in this process (its runs share the session's launcher and cache)."""
    status = main(["explain", "--outputs", str(tmp_path), *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_explain_prints_the_weights_and_signature_and_writes_figure_and_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _explain(tmp_path, capsys, "--recipe", "harness.recipes:extra_microbatch_division",
                                "--scenario", "long")
    assert 1 == status, out + err
    assert "diagnosis (global_scale): an extra division by the microbatch count k=5" in out
    assert "expected 1/N" in out and "parameter" in out
    stem = "explain-extra_microbatch_division-long-W2-fp32"
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert "global_scale" == data["signature"] and 10 == len(data["weights"])
    assert all(abs(w["ratio"] - 0.2) < 1e-5 for w in data["weights"])
    assert (tmp_path / f"{stem}.png").read_bytes().startswith(b"\x89PNG")


def test_explain_exits_0_on_the_correct_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _explain(tmp_path, capsys, "--recipe", "harness.recipes:global_token_mean", "--world-size", "3")
    assert 0 == status, out + err
    assert "diagnosis (correct)" in out


@pytest.mark.parametrize(("args", "named"), [
    (["--recipe", "harness.recipes:global_token_mean", "--scenario", "nope"], "--scenario='nope'"),
    (["--recipe", "harness.recipes:global_token_mean", "--world-size", "9"], "--world-size=9"),
    (["--recipe", "no.such.module:thing"], "--recipe"),
])
def test_explain_refuses_bad_input_with_exit_2_naming_the_argument(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], named: str) -> None:
    status, out, err = _explain(tmp_path, capsys, *args)
    assert 2 == status, out + err
    assert named in err
    assert not list(tmp_path.iterdir())
