"""``--batch-format packed`` end to end: the recipe receives padding-free rows (several sequences each,
:func:`harness.core.formats.to_packed`) and the reference is the same sequences unpacked, so the correct recipe passes
parity only if the packing, the separator and the built-in model's block-diagonal attention are exact."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks, registry
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec

assert checks  # registers the checks in registry.CHECKS

HF_CORRECT = "harness.recipes:hf_global_token_mean"
CORRECT = "harness.recipes:global_token_mean"


def _passes(spec: RunSpec, checks: tuple[str, ...] = ("parity", "logged_loss")) -> None:
    run = runner.run(spec)
    for check in checks:
        verdict = registry.CHECKS[check](run)
        assert verdict.passed, f"{check}: {verdict.message}"


def test_the_hf_correct_recipe_passes_parity_and_the_logged_loss_on_packed_rows() -> None:
    """W=2, uneven, float32: the packed rows' gradient and logged loss are the unpacked sequences' global token
    mean."""
    _passes(RunSpec(HF_CORRECT, "uneven", 2, "fp32", batch_format="packed"))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [HF_CORRECT, CORRECT])
@pytest.mark.parametrize(("world_size", "precision", "strategy"), [(3, "fp32", "ddp"), (2, "fp64", "ddp"),
                                                                   (2, "fp32", "fsdp2")])
def test_the_correct_recipes_pass_on_packed_rows(recipe: str, world_size: int, precision: str, strategy: str) -> None:
    """The default recipe (which takes dict batches through hf_forward) and the hf one, at W=3, in float64 and under
    FSDP2, on a scenario with several microbatches per rank and on one with an unsupervised rank."""
    for scenario in ("uneven", "one_empty"):
        _passes(RunSpec(recipe, scenario, world_size, precision, batch_format="packed", strategy=strategy),
                ("parity", "logged_loss", "one_sync"))


@pytest.mark.slow
def test_a_model_whose_attention_crosses_packed_boundaries_fails_parity_named_as_the_model() -> None:
    """The model control ``harness.model:crosses_packed_boundaries`` (positions from position_ids, attention causal
    over the whole packed row): the correct recipe fails parity on the numbers, and the diagnosis names the model, not
    the recipe, with the measured gap of its logits; the probe says the same before any rank starts. Its twin, the
    built-in model, passes the same case (the default-tier test above)."""
    from harness.battery.diagnose.of_run import diagnose
    from harness.battery.prepare.probe.facts import probe

    model = "harness.model:crosses_packed_boundaries"
    verdict = checks.parity(runner.run(RunSpec(HF_CORRECT, "uneven", 2, "fp32", batch_format="packed", model=model)))
    assert not verdict.passed and "numbers" == verdict.cause, verdict.message
    assert verdict.diagnosis is not None and "packing_crosses_boundaries" == verdict.diagnosis["signature"]
    found = diagnose(runner.run(RunSpec(HF_CORRECT, "uneven", 2, "fp32", batch_format="packed", model=model)))
    assert found is not None
    assert "attention crosses packed sequence boundaries: the packed forward's logits differ" in found.line()
    notes = probe(model, "packed").notes()
    assert any(n.startswith("attention crosses packed sequence boundaries") for n in notes), notes
    assert not any("packed" in n for n in probe(None, "packed").notes())


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_sequence_mean_recipe_passes_on_packed_rows_counting_sequences_not_rows(world_size: int) -> None:
    """``--objective sequence_mean --batch-format packed``: the sequence mean recipe tells a packed row's sequences
    apart by seq_idx and counts them, never the rows, so its gradient is the unpacked sequences' mean (its control,
    which counts rows, is packed_sequence_mean_over_rows)."""
    for scenario in ("uneven", "one_empty"):
        _passes(RunSpec("harness.recipes.objectives:sequence_mean", scenario, world_size, "fp32",
                        batch_format="packed", objective="sequence_mean"), ("parity", "logged_loss", "one_sync"))


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "objective"), [
    ("weighted_token_mean", "weighted_token_mean"), ("pg_token_mean", "token_mean"),
    ("pg_sequence_mean", "sequence_mean"), ("fixed_normalizer", "fixed_normalizer"),
    ("token_mean_with_z_loss", "token_mean"), ("token_mean_with_load_balance", "token_mean")])
def test_every_objective_recipe_passes_on_packed_rows(recipe: str, objective: str) -> None:
    """Each declared objective's correct recipe on packed rows, W=2, ``uneven``: the weights placed like the labels,
    the sequences counted by seq_idx, the auxiliary terms (per token, per microbatch) computed on the packed rows by
    the ranks and on the same sequences unpacked by the reference."""
    _passes(RunSpec(f"harness.recipes.objectives:{recipe}", "uneven", 2, "fp32", batch_format="packed",
                    objective=objective))
