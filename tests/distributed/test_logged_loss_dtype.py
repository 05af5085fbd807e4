"""The logged loss is judged at the tolerances of the dtype it was computed in: in the float64 lane, float32's where
the loss is known to be computed in float32 (a float32 tensor returned; a model the probe found computing in float32,
whose note says the lane judges it at float32's tolerances), and a miss at float32 scale that the battery cannot
attribute is named so. A logged loss wrong by more than float32's rounding still fails the float64 lane
(``tests/user_recipes/loss_dtype.py``)."""

from __future__ import annotations

import dataclasses

from harness.battery.judge import checks
from harness.battery.launch import runner

RECIPES = "user_recipes.loss_dtype"


def test_a_float32_loss_returned_as_a_float32_tensor_passes_the_float64_lane_at_float32s_tolerances() -> None:
    """The verdict says which tolerances judged it and why; the float32 lane passes it too."""
    verdict = checks.logged_loss(runner.run(f"{RECIPES}:as_tensor", "uneven", 2, "fp64"))
    assert "pass" == verdict.status, verdict.message
    assert verdict.message.endswith("(float32 tolerances: the recipe returned its loss as a torch.float32 tensor)")
    assert verdict.max_error is not None and verdict.max_error > 1e-9  # float32 rounding, over float64's tolerance
    assert checks.logged_loss(runner.run(f"{RECIPES}:as_tensor", "uneven", 2, "fp32")).passed


def test_a_float32_loss_returned_as_a_python_float_fails_the_float64_lane_naming_float32_computation() -> None:
    """Its dtype cannot be seen: the float64 lane fails it, reads float32 computation and says to return the
    tensor."""
    verdict = checks.logged_loss(runner.run(f"{RECIPES}:as_float", "uneven", 2, "fp64"))
    assert ("fail", "float32_computation") == (verdict.status, verdict.finding), verdict.message
    assert "Return the loss as the tensor it was computed in (loss.detach())" in verdict.message


def test_a_model_the_probe_found_computing_in_float32_has_its_logged_loss_judged_as_its_note_says() -> None:
    """The same Python float on a run whose model computes part of its forward in float32 (``computes_in``, the
    probe's note: "a lane of a higher precision judges it at float32's tolerances"): judged at float32's."""
    run = runner.run(f"{RECIPES}:as_float", "uneven", 2, "fp64")
    verdict = checks.logged_loss(dataclasses.replace(run, computes_in="torch.float32"))
    assert "pass" == verdict.status, verdict.message
    assert "(float32 tolerances: the model computes part of its forward in float32" in verdict.message


def test_a_logged_loss_wrong_by_more_than_float32_rounding_still_fails_the_float64_lane() -> None:
    """The mean of the ranks' means, returned as a float32 tensor: judged at float32's tolerances, it still fails,
    and no float32 finding excuses it (also on a model computing in float32)."""
    run = runner.run(f"{RECIPES}:mean_of_local_means", "uneven", 2, "fp64")
    for judged in (run, dataclasses.replace(run, computes_in="torch.float32")):
        verdict = checks.logged_loss(judged)
        assert ("fail", "numbers", None) == (verdict.status, verdict.cause, verdict.finding), verdict.message
        assert verdict.max_error is not None and verdict.max_error > 1e-3
