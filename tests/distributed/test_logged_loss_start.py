"""The logged-loss check judges at the warmed weights every run starts from (:mod:`harness.battery.prepare.start`),
where per-token losses differ: a logged loss weighted wrongly (the mean of the ranks' means, of the microbatches'
means, of the sequences' means; ``tests/user_recipes/logged.py``) fails it, on a model initialised as a Hugging Face
model is (``user_recipes.models:small_init_lm``: every initial token loss near log V). The control is the same run from
the initial weights (no warm-up), where each passes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import harness.battery.prepare.start as start
from harness.battery import scenarios
from harness.battery.judge import checks
from harness.battery.judge.verdict import Verdict
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.battery.spec import ModelSpec

MODEL = "user_recipes.models:small_init_lm"
WRONG = ("LoggedMeanOfLocalMeans", "LoggedMicrobatchMean", "LoggedSequenceMean")


@pytest.fixture
def initial_weights(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Runs start from the model's initial weights, as before the warm-up existed (the control)."""
    monkeypatch.setattr(start, "WARMUP_STEPS", 0)
    start._start.cache_clear()
    yield
    start._start.cache_clear()


def _logged(name: str, scenario: str = "uneven", world: int = 2) -> Verdict:
    spec = RunSpec(f"user_recipes.logged:{name}", scenario, world, "fp32", model=MODEL)
    return checks.logged_loss(runner.launch_run(spec, scenarios.build(scenario, world)))


def test_the_start_is_the_initial_weights_moved_and_every_rank_receives_it_bitwise() -> None:
    """The warmed weights differ from the initial ones, are finite, and what the ranks start from is exactly them
    (the first window's params_before)."""
    spec = ModelSpec(MODEL)
    warmed, initial = start.start_weights(spec), torch.cat([p.detach().flatten() for p in spec.build().parameters()])
    assert warmed is not None and bool(torch.isfinite(warmed).all()) and not torch.equal(warmed, initial)
    run = runner.launch_run(RunSpec("user_recipes.logged:LoggedMicrobatchMean", "uneven", 2, "fp32", model=MODEL),
                            scenarios.build("uneven", 2))
    assert run.records is not None and all(torch.equal(warmed, r[0].params_before) for r in run.records)
    verdict = checks.logged_loss(run)
    assert ("fail", "numbers") == (verdict.status, verdict.cause), verdict.message


def test_a_per_microbatch_logged_mean_passes_at_the_initial_weights(initial_weights: None) -> None:
    """The control: from the initial weights, where every token's loss is near log V, the per-microbatch mean the
    warmed run rejects is within the float32 tolerance of the global token mean."""
    verdict = _logged("LoggedMicrobatchMean")
    assert "pass" == verdict.status, verdict.message


def _passes(names: tuple[str, ...]) -> dict[str, list[str]]:
    return {n: [s for s in scenarios.BATTERY_SCENARIOS if s != "all_empty" and _logged(n, s).status == "pass"]
            for n in names}


@pytest.mark.slow  # 24 launches of a user's model
def test_wrongly_weighted_logged_losses_fail_where_they_passed_and_the_right_one_passes(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """In every scenario with tokens at W=2: from the initial weights each wrong logged loss passes in most
    scenarios (the control); from the warmed weights it fails in at least 4 of 5 of those; the global token mean
    passes everywhere."""
    monkeypatch.setattr(start, "WARMUP_STEPS", 0)
    start._start.cache_clear()
    before = _passes(WRONG)
    monkeypatch.undo()
    start._start.cache_clear()
    after = _passes(WRONG)
    for name in WRONG:
        assert len(before[name]) >= 3, (name, before[name])
        still = set(before[name]) & set(after[name])
        assert len(still) * 5 <= len(before[name]), (name, sorted(still))
    right = _passes(("LoggedGlobalTokenMean",))["LoggedGlobalTokenMean"]
    assert len(scenarios.BATTERY_SCENARIOS) - 1 == len(right), right
