"""transformers' own ``Trainer`` inner loop (``integrations.trainer_loop``: the real ``Trainer``, ``get_batch_samples``,
then ``training_step`` per microbatch under ``accelerator.no_sync``) on a float64 and a float32 Llama: a correct
library setup, so every check it is judged by passes. In the float64 lane its logged loss, computed in float32,
is judged at float32's tolerances as the model's note says; on a window without any supervised token its NaN loss
beside zero gradients passes with the note to skip the optimizer step."""

from __future__ import annotations

import dataclasses

import pytest

import harness.battery.judge.checks  # noqa: F401  (the checks register themselves in REGISTRY when imported)
from harness.battery.judge import registry
from harness.battery.launch import runner
from harness.recipes.libraries._common import EXTRA_HINT

pytestmark = [pytest.mark.integrations, pytest.mark.xdist_group("trainer_inner_loop")]

LOOP = "integrations.trainer_loop:trainer_inner_loop"
MODEL = "integrations.hf_models:tiny_llama"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is fetched: the model is built from a config


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_the_trainer_inner_loop_passes_every_check_of_the_uneven_window(precision: str) -> None:
    """parity, one_sync, logged_loss and hygiene pass in both lanes; the float64 lane's logged loss says it was judged
    at float32's tolerances, the model's note beside it saying the same."""
    run = runner.run(LOOP, "uneven", 2, precision, model=MODEL, batch_format="hf")
    verdicts = [registry.CHECKS[c](run) for c in ("parity", "one_sync", "logged_loss", "hygiene")]
    assert [] == [v.message for v in verdicts if v.status != "pass"]
    if precision == "fp64":
        assert any("judges it at torch.float32's tolerances" in note for note in run.notes), run.notes
        assert "(float32 tolerances: the model computes part of its forward in float32" in verdicts[2].message


def test_a_trainer_loop_logging_a_loss_off_by_more_than_float32_rounding_fails_the_float64_lane() -> None:
    """The negative control: the same float64 run, its logged loss 1e-3 off (ten times float32's relative
    tolerance), fails."""
    run = runner.run(LOOP, "uneven", 2, "fp64", model=MODEL, batch_format="hf")
    assert run.records is not None
    off = [[dataclasses.replace(r, logged=None if r.logged is None else r.logged * (1 + 1e-3)) for r in records]
           for records in run.records]
    verdict = registry.CHECKS["logged_loss"](dataclasses.replace(run, records=off))
    assert ("fail", "numbers") == (verdict.status, verdict.cause), verdict.message


@pytest.mark.parametrize("world", [1, 2])
def test_the_trainer_inner_loop_passes_the_empty_window_with_the_note_to_skip_the_step(world: int) -> None:
    """No supervised token: ``num_items_in_batch`` is 0, the loss 0/0 = NaN, every gradient zero, no error: the
    zero-gradient policy, with the note naming what the loop must do."""
    verdict = registry.CHECKS["empty_window"](runner.run(LOOP, "all_empty", world, model=MODEL, batch_format="hf"))
    assert "pass" == verdict.status, verdict.message
    assert any("unless the loop skips optimizer.step() when the window's global count is 0" in n
               for n in verdict.notes), verdict.notes
