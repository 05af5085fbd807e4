"""Drawn layouts: the battery's checks on windows nobody wrote by hand.

Hypothesis draws world sizes 1-4, 1-6 microbatches per window, row lengths and prompt prefixes, microbatches and
whole ranks without any supervised token, and the model's initial weights (``harness.battery.layouts``); every
example checks parity, one synchronization per window and the logged loss of ``--recipe``. ``--battery-examples``
sets the budget (0: none, the test skips), ``--battery-world-sizes`` the world sizes drawn from, and
``--battery-deadline`` each launch's deadline; under ``CI=true`` the examples are derandomized (the same on every
run). A failure prints the drawn layout and a shrunk one that still fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from harness.battery.checks import Verdict
from harness.battery.options import BatteryOptions

pytestmark = pytest.mark.recipe


def test_drawn_layouts_keep_parity_one_sync_and_the_logged_loss(
    recipe_path: str, battery_options: BatteryOptions, battery_check: Callable[[Verdict], None]
) -> None:
    """On every drawn layout the recipe's gradient is the reference's, one sync per window, the right logged loss."""
    if battery_options.examples == 0:
        pytest.skip("--battery-examples 0: no drawn layouts")
    pytest.importorskip("hypothesis", reason="the drawn-layout lane needs hypothesis (the harness's [test] extra)")
    from harness.battery.layouts import drawn_verdict

    ci = os.environ.get("CI", "").strip().lower() == "true"
    battery_check(drawn_verdict(recipe_path, battery_options, derandomize=ci))
