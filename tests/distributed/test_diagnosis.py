"""Every negative control is diagnosed with its own signature on real ranks, failing verdicts carry the diagnosis
in one line (message, table, JSON), and ``python -m harness explain`` prints and writes it.

Each control's signature (``harness.recipes.DIAGNOSES``) is asserted on its target at W=2 and W=3 (or at the world
sizes its target declares) beside its rejection (``test_negative_controls.py``); here, the words for the ones whose
sentence carries a count, a block or a world size.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.groups import control_group

from harness.battery.diagnose.of_run import diagnose
from harness.battery.judge import checks
from harness.battery.judge.verdict import Verdict
from harness.battery.launch import runner
from harness.battery.report.table import format_table, report_json
from harness.diagnosis.signatures import SIGNATURES
from harness.recipes import CONTROLS, DIAGNOSES
from harness.workflow.cli import main

CORRECT_RECIPE_PATH = "harness.recipes:global_token_mean"

PHRASES = {
    # control: what its diagnosis must say, read at W=3 on its target (W=3 tells 1/W from 1/k on the uneven window),
    # or at the world size its target declares (a factor written for W=2 shows at W=4 only).
    "no_world_size_factor": "world-size factor is missing",
    "extra_microbatch_division": "microbatch count k=5",
    "count_from_one_microbatch": "normalized by",
    "cached_count": "window 0's global count",
    "two_microbatch_loop": "microbatch 2 ",
    "fixed_accumulation_steps": "microbatch 4 contributed nothing",
    "first_microbatch_never_syncs": "never synchronized",
    "mean_of_local_means": "rank 0's tokens weigh 5x rank 2's",
    "hard_coded_world_size": "a world-size factor written for W=2 (every weight is 2/W, here W=4)",
    "averaged_count": "a count averaged over the ranks (divided by W) and multiplied by a factor 2 written for W=2",
}


def phrase_world(name: str) -> int:
    """The world size a control's words are read at: its target's last declared one, else 3."""
    return (CONTROLS[name].world_sizes or (3,))[-1]


def test_every_control_declares_its_diagnosis() -> None:
    """The signatures themselves are asserted on every control at W=2 and W=3 by
    ``test_negative_controls.py::test_each_control_is_rejected_by_its_targeted_check_for_its_own_mistake``, on the
    same (cached) runs."""
    assert sorted(CONTROLS) == sorted(DIAGNOSES)
    assert set(DIAGNOSES.values()) - {None} <= set(SIGNATURES)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(control_group(n, phrase_world(n))))
                                  for n in PHRASES])
def test_each_diagnosis_names_the_mistake_in_words(name: str) -> None:
    """On the run the negative-control test judges (the same xdist group: one launch for both)."""
    t = CONTROLS[name]
    found = diagnose(runner.run(f"harness.recipes:{name}", t.scenario, phrase_world(name), t.precision,
                                batch_format=t.batch_format))
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
    # The reading ends with its fix, on the next line: the factor it found, named, and the right division.
    after = out.split("diagnosis (global_scale)", 1)[1].splitlines()[1]
    assert after.startswith("fix: every weight is 0.2x the right one: drop the extra division by the microbatch "
                            "count k=5"), after
    assert "expected 1/N" in out and "parameter" in out
    stem = "explain-harness.recipes-extra_microbatch_division-long-W2-fp32"
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert "global_scale" == data["signature"] and 10 == len(data["weights"])
    assert after == f"fix: {data['fix']}"
    assert all(abs(w["ratio"] - 0.2) < 1e-5 for w in data["weights"])
    assert (tmp_path / f"{stem}.png").read_bytes().startswith(b"\x89PNG")
    # Then the recipe-level diagnosis over the battery's quick scenarios, as the battery's last screen states it, and
    # the status line naming it.
    assert "over the battery's quick scenarios (long, uneven, single, one_empty) at W=2, in ddp/fp32:" in out
    assert "\nrecipe-level diagnosis (" in out, out
    assert out.rstrip().splitlines()[-1].startswith("FAILED: explain: harness.recipes:extra_microbatch_division: "
                                                    "recipe-level diagnosis ("), out


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


# --- Issue 18: readings held to the verdict, causes named for what they are (recipes in tests/user_recipes) -------


def _parity(recipe: str, scenario: str, world: int, precision: str = "fp32",
            model: str | None = None) -> Verdict:
    verdict = checks.parity(runner.run(recipe, scenario, world, precision, model=model))
    assert not verdict.passed and verdict.diagnosis is not None, verdict.message
    assert "correct" != verdict.diagnosis["signature"], verdict.message
    return verdict


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp64", marks=pytest.mark.slow)])
def test_an_auxiliary_l2_penalty_reads_extra_term_naming_its_layer(precision: str) -> None:
    verdict = _parity("user_recipes.diagnosed:auxiliary_l2_penalty", "uneven", 2, precision)
    found = verdict.diagnosis
    assert found is not None and "extra_term" == found["signature"], verdict.message
    assert ["blocks.0.mlp.2.weight"] == found["blocks_named"]
    assert "carried by blocks.0.mlp.2.weight" in str(found["sentence"])
    thresholds = found["thresholds"]
    assert isinstance(thresholds, dict) and {"explained_residual", "rounding_residual"} <= set(thresholds)
    shares = {p["name"]: p["residual_share"] for p in found["parameters"]}  # type: ignore[union-attr]
    assert shares["blocks.0.mlp.2.weight"] > 0.99


def test_a_fixed_accumulation_constant_reads_k_4_on_a_window_of_5() -> None:
    verdict = _parity("user_recipes.diagnosed:fixed_accumulation_constant", "long", 2)
    assert verdict.diagnosis is not None and "fixed_accumulation_constant" == verdict.diagnosis["signature"]
    assert "K=4 where the window has k=5 microbatches" in verdict.message


def test_a_loss_divided_by_w_twice_reads_w_twice_at_three_ranks() -> None:
    verdict = _parity("user_recipes.diagnosed:world_size_divided_twice", "uneven", 3)
    assert verdict.diagnosis is not None and "global_scale" == verdict.diagnosis["signature"]
    assert "diagnosis (global_scale): the loss divided by W twice" in verdict.message
    assert "tokens where the window holds" not in verdict.message


@pytest.mark.parametrize("world", [2, 3])
def test_a_stale_first_count_reads_block_scaled_with_the_local_counts(world: int) -> None:
    verdict = _parity("user_recipes.diagnosed:stale_first_count", "uneven", world)
    assert verdict.diagnosis is not None and "block_scaled" == verdict.diagnosis["signature"], verdict.message
    assert f"rank {world - 1}'s microbatch 0 weighs" in verdict.message
    assert f"rank {world - 1}'s local count" in verdict.message and "every other block right" in verdict.message


def test_a_stateful_forward_reads_model_not_fixed_never_correct() -> None:
    verdict = _parity(CORRECT_RECIPE_PATH, "uneven", 2, model="user_recipes.zoo:CountingLM")
    assert verdict.diagnosis is not None and "model_not_fixed" == verdict.diagnosis["signature"], verdict.message
    assert "recipe is not blamed" in verdict.message


def test_an_hf_count_taken_before_the_shift_is_named_as_that_count() -> None:
    """N plus one token per unprompted row is a count of the window: named, not "no token count"."""
    run = runner.run("harness.recipes:hf_count_before_shift", "uneven", 2, batch_format="hf")
    verdict = checks.parity(run)
    assert verdict.diagnosis is not None and "global_scale" == verdict.diagnosis["signature"]
    assert "normalized by the hf labels counted before the shift" in verdict.message, verdict.message


@pytest.mark.xdist_group(control_group("packed_count_from_row_length", 2))
def test_a_count_of_the_packed_rows_real_tokens_is_named_as_that_count() -> None:
    """N plus each sequence's first position (the separator) and its prompt: the packed rows' real tokens, an
    attention mask's sum, named (the same run the negative-control test judges)."""
    run = runner.run("harness.recipes:packed_count_from_row_length", "uneven", 2, batch_format="packed")
    verdict = checks.parity(run)
    assert verdict.diagnosis is not None and "global_scale" == verdict.diagnosis["signature"]
    assert "normalized by the packed rows' real tokens" in verdict.message, verdict.message


@pytest.mark.slow
@pytest.mark.parametrize(("name", "words", "fix"), [
    pytest.param("packed_count_across_boundaries", "every token weighs 1/(N + B) = 1/",
                 "count only the labels that are not -100 after the shift",
                 marks=pytest.mark.xdist_group(control_group("packed_count_across_boundaries", 2))),
    pytest.param("packed_labels_rebuilt_and_counted", "pairs across the packed sequences' boundaries beside the",
                 "keep the batch's labels (-100 at every sequence's first position",
                 marks=pytest.mark.xdist_group(control_group("packed_labels_rebuilt_and_counted", 2))),
])
def test_a_packed_count_that_takes_the_boundaries_for_targets_is_named_with_its_fix(name: str, words: str,
                                                                                     fix: str) -> None:
    """The boundaries counted (the batch's loss over N + B), and the boundary pairs supervised and counted (labels
    rebuilt over the row over their own N + B): each named with the count and its fix (the same run the
    negative-control test judges)."""
    verdict = checks.parity(runner.run(f"harness.recipes:{name}", "uneven", 2, batch_format="packed"))
    assert verdict.diagnosis is not None and DIAGNOSES[name] == verdict.diagnosis["signature"], verdict.message
    assert words in verdict.message and "1/N is right" in verdict.message, verdict.message
    assert fix in str(verdict.diagnosis["fix"]), verdict.diagnosis["fix"]


@pytest.mark.slow
@pytest.mark.xdist_group(control_group("fsdp2_sync_every_microbatch", 2))
def test_explain_under_fsdp2_never_reads_right_what_the_battery_rejects_and_speaks_fsdp2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An FSDP2 loop that syncs every microbatch leaves the right gradient; the battery rejects it by its sync count,
    and so does explain (exit 1), in FSDP2's words: set_requires_gradient_sync(False), never no_sync() (the same run
    the negative-control test judges)."""
    status, out, err = _explain(tmp_path, capsys, "--recipe", "harness.recipes:fsdp2_sync_every_microbatch",
                                "--strategy", "fsdp2", "--no-recipe-level")
    assert 1 == status, out + err
    assert "FAILED: explain: the weighting is right, but the battery rejects this case (fsdp2, fp32): one_sync" in out
    assert "set_requires_gradient_sync(False)" in out and "no_sync()" not in out
    assert "    fix: call model.set_requires_gradient_sync(False) before every microbatch but the last" in out
    assert (tmp_path / "explain-harness.recipes-fsdp2_sync_every_microbatch-uneven-W2-fp32-fsdp2.json").exists()


@pytest.mark.slow
def test_explain_reads_an_fsdp2_only_mistake_that_ddp_cannot_show(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """FSDP2's divisor knobs set on the root only: under --strategy fsdp2 the gradient is 1/W (exit 1, as the
    battery); the correct recipe under FSDP2 is the control (exit 0)."""
    status, out, err = _explain(tmp_path, capsys, "--recipe", "harness.recipes:divide_factor_on_root_only",
                                "--strategy", "fsdp2")
    assert 1 == status and "diagnosis (global_scale)" in out, out + err
    assert not checks.parity(runner.run("harness.recipes:divide_factor_on_root_only", "uneven", 2,
                                        strategy="fsdp2")).passed
    status, out, err = _explain(tmp_path, capsys, "--recipe", CORRECT_RECIPE_PATH, "--strategy", "fsdp2")
    assert 0 == status, out + err
    assert "the weighting is right (fsdp2, fp32)" in out


@pytest.mark.slow
def test_explain_describes_a_right_sequence_mean_in_its_own_words(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Under --objective sequence_mean the right weighting is the sequence mean's (1/S shared by a sequence's tokens),
    never "every token weighs 1/N" nor "the global token mean"."""
    status, out, err = _explain(tmp_path, capsys, "--recipe", "harness.recipes.objectives:sequence_mean",
                                "--objective", "sequence_mean")
    assert 0 == status, out + err
    assert "the weighting is right for the sequence mean (each sequence with a supervised token weighs 1/S" in out
    assert "every token weighs 1/N" not in out and "global token mean" not in out


@pytest.mark.slow
def test_explain_reads_the_bf16_lane_to_its_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--precision bf16 reads the gradient to the accuracy its derived bound allows: a mean of local means is still
    named, and the line says the bound."""
    status, out, err = _explain(tmp_path, capsys, "--recipe", "harness.recipes:mean_of_local_means", "--precision",
                                "bf16")
    assert 1 == status, out + err
    assert "diagnosis (mean_of_local_means)" in out and "read from a bf16 gradient" in out


@pytest.mark.slow
def test_an_auxiliary_term_beside_right_weights_read_less_exactly_is_still_read() -> None:
    """On varying at W=4 the joint fit of the blocks and the auxiliary term reads the main weights to 1e-5 only (its
    condition is high), where it read 'every weight is 1 times the right one' (global_scale); the term is read."""
    verdict = checks.parity(runner.run("harness.recipes:auxiliary_summed_over_ranks", "varying", 4))
    assert verdict.diagnosis is not None, verdict.message
    assert "auxiliary_summed_over_ranks" == verdict.diagnosis["signature"], verdict.message


def test_a_model_that_cannot_run_in_float64_is_diagnosed_in_its_own_dtype() -> None:
    """A model whose float64 forward raises (a float32 table kept as a plain attribute, as transformers' grouped_mm
    experts raise on a CPU torch) is recomputed in float32 by the diagnosis, as the pre-flight checks its backward:
    the per-microbatch mean reads its own cause instead of the diagnosis's traceback. The built-in model still runs
    in float64 (the control)."""
    from harness.battery.spec import ModelSpec
    from harness.diagnosis.evidence import runs_in_float64

    path = "user_recipes.backward_models:Float32OnlyLM"
    run = runner.run("harness.recipes:per_microbatch_mean", "uneven", 2, "fp32", model=path)
    verdict = checks.parity(run)
    assert verdict.diagnosis is not None and "per_microbatch_mean" == verdict.diagnosis["signature"], verdict.message
    probe = run.windows[0][0][0]
    assert not runs_in_float64(ModelSpec(path), probe)
    assert runs_in_float64(ModelSpec(None), probe)


def test_a_lane_whose_truth_is_float64_is_not_judged_on_a_model_that_cannot_run_there(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The default lanes (fp32 and fp64) on a model whose float64 forward raises: the fp32 lane is judged, every fp64
    case is n/a before any rank starts, the model's note says why and the last line says the lane was not judged (it
    used to end in the reference chain's traceback). The built-in model runs in float64: nothing is refused there."""
    from harness.battery.plan.options import RunSpec
    from harness.battery.prepare.steps import float64_refusal

    path = "user_recipes.backward_models:Float32OnlyLM"
    status = main(["battery", "--recipe", "harness.recipes:global_token_mean", "--model", path, "--precision", "both",
                   "--battery-world-sizes", "2", "--battery-examples", "2"])
    out = capsys.readouterr().out
    assert 0 == status, out
    assert "the model cannot run in float64 (RuntimeError: expected m1 and m2" in out
    assert out.rstrip().endswith("every check holds (not judged: the fp64 lane, every case n/a on this model; see "
                                 "above why)"), out[-600:]
    report = json.loads(Path(out.split("full report: ", 1)[1].split(" ", 1)[0]).read_text())
    lanes = {(v["precision"], v["status"]) for v in report["checks"]}
    assert ("fp64", "n/a") in lanes and ("fp32", "pass") in lanes and ("fp64", "pass") not in lanes
    assert float64_refusal(RunSpec("harness.recipes:global_token_mean", "uneven", 2, "fp64", model=path))
    assert float64_refusal(RunSpec("harness.recipes:global_token_mean", "uneven", 2, "fp64")) is None
