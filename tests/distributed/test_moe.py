"""The built-in mixture-of-experts model (``--model harness.moe:moe``) under the battery: routing is per token and
keeps no state, so the correct recipe's gradient is the single-device one, and a wrong normalization still fails
parity with its own reading."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks
from harness.battery.launch import runner

MOE = "harness.moe:moe"


@pytest.mark.slow
def test_the_correct_recipe_passes_on_the_moe_model_and_a_mean_of_local_means_is_read_as_one() -> None:
    """``global_token_mean`` holds parity, the logged loss, one synchronization and agreeing ranks on ``uneven`` at
    W=2 (DDP with find_unused_parameters: the model declares experts, which routing may leave without a token); the
    control
    ``mean_of_local_means`` fails parity on the numbers and is diagnosed as ``mean_of_local_means``."""
    run = runner.run("harness.recipes:global_token_mean", "uneven", 2, model=MOE)
    assert run.find_unused
    for check in (checks.parity, checks.logged_loss, checks.one_sync, checks.ranks_agree):
        verdict = check(run)
        assert verdict.passed, verdict.message
    wrong = checks.parity(runner.run("harness.recipes:mean_of_local_means", "uneven", 2, model=MOE))
    assert "fail" == wrong.status and "numbers" == wrong.cause, wrong.message
    assert wrong.diagnosis is not None and "mean_of_local_means" == wrong.diagnosis["signature"]
