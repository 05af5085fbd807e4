"""Every negative control is diagnosed with its own signature on real ranks, failing verdicts carry the diagnosis
in one line (message, table, JSON), and ``python -m harness explain`` prints and writes it.

Each control's signature (``harness.recipes.DIAGNOSES``) is asserted on its target at W=2 and W=3 beside its
rejection (``test_negative_controls.py``); here, the words for the ones whose sentence carries a count or a block.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.battery import checks, runner
from harness.battery.diagnose import diagnose
from harness.battery.table import format_table, report_json
from harness.core.diagnosis import SIGNATURES
from harness.recipes import CONTROLS, DIAGNOSES
from harness.workflow.cli import main

PHRASES = {
    # control: what its diagnosis must say, read at W=3 on its target (W=3 tells 1/W from 1/k on the uneven window).
    "no_world_size_factor": "world-size factor is missing",
    "extra_microbatch_division": "microbatch count k=5",
    "count_from_one_microbatch": "normalized by",
    "cached_count": "window 0's global count",
    "two_microbatch_loop": "microbatch 2 ",
    "fixed_accumulation_steps": "microbatch 4 contributed nothing",
    "first_microbatch_never_syncs": "never synchronized",
    "mean_of_local_means": "rank 0's tokens weigh 4x rank 2's",
}


def test_every_control_declares_its_diagnosis() -> None:
    """The signatures themselves are asserted on every control at W=2 and W=3 by
    ``test_negative_controls.py::test_each_control_is_rejected_by_its_targeted_check_for_its_own_mistake``, on the
    same (cached) runs."""
    assert sorted(CONTROLS) == sorted(DIAGNOSES)
    assert set(DIAGNOSES.values()) - {None} <= set(SIGNATURES)


@pytest.mark.parametrize("name", list(PHRASES))
def test_each_diagnosis_names_the_mistake_in_words(name: str) -> None:
    t = CONTROLS[name]
    found = diagnose(runner.run(f"harness.recipes:{name}", t.scenario, 3, t.precision))
    assert found is not None
    assert DIAGNOSES[name] == found.signature.name, found.line()
    assert PHRASES[name] in found.line(), found.line()


def test_the_correct_recipe_weighs_every_token_1_over_n_within_1e_5() -> None:
    """The fp32 bound the catalog calls right (the measured distance is ``max_ratio_error`` in
    ``benchmarks/results/diagnosis.json``)."""
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
    stem = "explain-harness.recipes-extra_microbatch_division-long-W2-fp32"
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


def test_a_parameter_ddp_never_synchronizes_is_located_by_the_per_parameter_view() -> None:
    """Not a normalization mistake: the correct recipe on a user model that hides conv2.weight from DDP. The weights
    cannot explain the gradient, and the per-parameter table names that tensor alone."""
    run = runner.run("harness.recipes:global_token_mean", "uneven", 2,
                     model="user_recipes.models:hides_a_parameter_from_ddp")
    verdict = checks.parity(run)
    assert not verdict.passed and verdict.diagnosis is not None
    assert "unexplained" == verdict.diagnosis["signature"]
    assert "1 of 7 parameter tensors are off: conv2.weight" in verdict.message
    off = [p for p in verdict.diagnosis["parameters"] if p["over_tolerance"]]  # type: ignore[union-attr]
    assert ["conv2.weight"] == [p["name"] for p in off]
