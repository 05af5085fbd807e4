"""Readings that name the window fact they found, on real ranks, each with a correct recipe that gets none: an
unnormalized sum, a count rounded to bf16 or one token too large, W times a rank's own count (under every objective),
an FSDP2 sync never re-enabled, a bf16 remark only where the residue is one rounding, a token mean per microbatch
judged under the sequence mean, and an auxiliary term off by W*k. The recipes are in
``tests/user_recipes/diagnosed.py``, written with torch alone; the sentences' arithmetic is in
``tests/unit/test_window_readings.py``.

One representative runs in the default tier; the rest are ``slow``. The assertions read the words, never a
scenario's counts: a scenario whose N does not round in bf16 is left out of the bf16 test by that test itself.
"""

from __future__ import annotations

import pytest
import torch

from harness.battery import scenarios
from harness.battery.judge import checks
from harness.battery.judge.verdict import Verdict
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec

D = "user_recipes.diagnosed"


def _parity(recipe: str, scenario: str = "uneven", world: int = 3, **fields: object) -> Verdict:
    return checks.parity(runner.run(RunSpec(f"{D}:{recipe}", scenario, world, "fp32", **fields)))  # type: ignore[arg-type]


def _line(verdict: Verdict) -> str:
    assert not verdict.passed and verdict.diagnosis is not None, verdict.message
    return str(verdict.diagnosis["line"])


def test_an_unnormalized_loss_sum_reads_as_one() -> None:
    """Each rank's loss sum backpropagated whole (every weight N/W times too large) reads as an unnormalized sum,
    never "no token count"."""
    line = _line(_parity("unnormalized_sum"))
    assert line.startswith("diagnosis (global_scale): the loss was never divided by a token count (an unnormalized "
                           "loss sum)"), line


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "strategy"), [("right_token_mean", "ddp"), ("fsdp2_right", "fsdp2")],
                         ids=["ddp", "fsdp2"])
def test_the_correct_counterparts_get_no_diagnosis(recipe: str, strategy: str) -> None:
    verdict = _parity(recipe, world=2, strategy=strategy)
    assert verdict.passed and verdict.diagnosis is None, verdict.message


@pytest.mark.slow
def test_a_count_all_reduced_in_bf16_is_named_as_its_rounding() -> None:
    """Every scenario whose N rounds in bfloat16 fails and names bfloat16; at least two such scenarios run."""
    seen = 0
    for scenario in ("uneven", "single", "long"):
        n = sum(mb.supervised for rank in scenarios.build(scenario, 2)[0] for mb in rank)
        if float(torch.tensor(float(n)).to(torch.bfloat16)) == n:
            continue  # N is a bf16 number here: the recipe is right on this window
        line = _line(_parity("count_in_bf16", scenario, world=2))
        assert "bfloat16" in line and "no token count" not in line, line
        seen += 1
    assert seen >= 2


@pytest.mark.slow
def test_a_count_one_too_large_reads_n_plus_one() -> None:
    line = _line(_parity("count_plus_one"))
    assert "N plus one" in line and "no token count" not in line, line


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "objective"), [
    ("w_times_own_count", "token_mean"), ("advantage_own_count", "token_mean"),
    ("weighted_own_count", "weighted_token_mean"),
], ids=["plain", "advantages", "weighted"])
def test_w_times_the_ranks_own_count_reads_a_mean_of_local_means_under_every_objective(recipe: str,
                                                                                        objective: str) -> None:
    """Never "its padded length, its size": the divisor is named as the rank's own count."""
    line = _line(_parity(recipe, objective=objective))
    assert line.startswith("diagnosis (mean_of_local_means): each rank's tokens weigh 1/(W * its own count)"), line
    assert "its own count" in line and "padded length" not in line


@pytest.mark.slow
def test_an_fsdp2_sync_never_reenabled_reads_not_synchronized() -> None:
    """The all-zero gradient FSDP2 leaves is named like DDP's missing sync, never unexplained."""
    line = _line(_parity("fsdp2_sync_never_reenabled", world=2, strategy="fsdp2"))
    assert line.startswith("diagnosis (not_synchronized):") and "set_requires_gradient_sync(True)" in line, line


@pytest.mark.slow
def test_a_mild_reweighting_is_not_blamed_on_bf16_and_a_bf16_cast_is() -> None:
    """Tokens re-weighted by up to 7% in float32 carry no bf16 remark; the control, logits cast to bf16, does."""
    mild = _parity("position_weighted", world=2)
    assert not mild.passed and mild.finding is None and "bfloat16" not in mild.message, mild.message
    cast = _parity("logits_in_bf16", world=2)
    assert not cast.passed and "bf16_computation" == cast.finding, cast.message


@pytest.mark.slow
def test_a_token_mean_per_microbatch_under_the_sequence_mean_is_named_by_what_it_computes() -> None:
    """The per-sequence view fits it exactly: "a token mean over each microbatch", never "not a re-weighting"; the
    sequence-mean recipe (the control) passes."""
    verdict = _parity("mean_per_microbatch", world=2, objective="sequence_mean")
    line = _line(verdict)
    assert line.startswith("diagnosis (per_microbatch_mean): a token mean over each microbatch"), line
    right = checks.parity(runner.run(RunSpec("harness.recipes.objectives:sequence_mean", "uneven", 2, "fp32",
                                             objective="sequence_mean")))
    assert right.passed and right.diagnosis is None, right.message


@pytest.mark.slow
def test_an_auxiliary_term_off_by_w_times_k_is_named_by_that_factor() -> None:
    line = _line(_parity("auxiliary_times_w"))
    assert "a factor W*k" in line and "no count of this window names" not in line, line
