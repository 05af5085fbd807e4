"""Drawn layouts: the battery's checks on windows nobody wrote by hand.

Hypothesis draws world sizes 1-4, 1-6 microbatches per window, row lengths and prompt prefixes, microbatches and
whole ranks without any supervised token, and the model's initial weights (``harness.battery.layouts``), after two
layouts chosen so that the usual mistakes read apart; every layout is judged by every check that applies to
``--recipe`` (parity, one synchronization, ranks agree, the logged loss, hygiene, clipping, weights unchanged), in
every precision lane (``--precision``; the bf16 lane with its derived bound) and strategy (``--strategy``) of the
session: one test per lane and strategy. ``--battery-examples`` sets the budget (0: none, the test skips),
``--battery-world-sizes`` the world sizes drawn from, and ``--battery-deadline`` each launch's deadline; under
``CI=true`` the examples are derandomized (the same on every run). A failure prints the failing layout with its
diagnosis and a shrunk one that still fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from harness.battery.judge.verdict import Verdict
from harness.battery.plan.cases import DrawnLane
from harness.battery.plan.options import BatteryOptions

pytestmark = pytest.mark.recipe


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "lane" not in metafunc.fixturenames:
        return
    from harness.battery.plan.cases import drawn_lanes
    from harness.battery.plan.options import from_pytest

    options = from_pytest(metafunc.config)
    # --battery-examples 0: one lane still collected, so that the test says why it skips.
    lanes = drawn_lanes(options) or [DrawnLane(options.lanes[0], options.strategy_lanes[0])]
    metafunc.parametrize("lane", lanes, ids=[lane.id for lane in lanes])


def test_drawn_layouts_pass_every_check_that_applies(
    lane: DrawnLane, recipe_path: str, battery_options: BatteryOptions, battery_check: Callable[[Verdict], None]
) -> None:
    """On every drawn layout, in this precision lane and strategy, the recipe passes every check that applies."""
    if battery_options.examples == 0:
        pytest.skip("--battery-examples 0: no drawn layouts")
    pytest.importorskip("hypothesis", reason="the drawn-layout lane needs hypothesis (the harness's [test] extra)")
    from harness.battery.layouts import drawn_verdict

    ci = os.environ.get("CI", "").strip().lower() == "true"
    battery_check(drawn_verdict(recipe_path, battery_options, derandomize=ci,
                                precision=lane.precision, strategy=lane.strategy, examples=lane.examples,
                                mesh=lane.mesh))
