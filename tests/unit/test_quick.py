"""``--quick`` (``harness.battery.plan.selection``): the cases that tell the known mistakes apart (W=2 and 3, fp32, the
uneven, single and one_empty scenarios, the two chosen drawn layouts), and an explicit world size, precision or
drawn budget winning over its choice."""

from __future__ import annotations

import pytest

from harness.battery.plan import cases as plan
from harness.battery.plan.cases import DrawnLane
from harness.battery.plan.options import BatteryOptions


def test_quick_runs_w2_and_3_in_fp32_on_the_three_scenarios_that_tell_mistakes_apart() -> None:
    """The quick plan: every case at W in {2, 3}, fp32, on uneven, single or one_empty; every check that runs
    there; one drawn lane of the two chosen layouts."""
    options = BatteryOptions.parse(quick=True)
    cases = plan.session_cases(options)
    assert {2, 3} == {c.world_size for c in cases}
    assert {"fp32"} == {c.precision for c in cases}
    assert {"uneven", "single", "one_empty"} == {c.scenario for c in cases}
    assert {"parity", "one_sync", "ranks_agree", "logged_loss", "hygiene", "clipping", "weights_unchanged"} <= {
        c.check for c in cases}
    assert [DrawnLane("fp32", "ddp", 2)] == plan.drawn_lanes(options)
    full = plan.session_cases(BatteryOptions())
    assert set(cases) < set(full)  # a subset of the full battery's cases, not other ones


def test_quick_s_cases_are_the_full_plan_s_on_those_scenarios_world_sizes_and_precision() -> None:
    """Nothing the full battery runs on those scenarios at W=2,3 in fp32 is left out."""
    full = plan.cases((2, 3), "fp32")
    assert [c for c in full if c.scenario in ("uneven", "single", "one_empty")] == plan.session_cases(
        BatteryOptions.parse(quick=True))


@pytest.mark.parametrize(("given", "expected"), [
    ({"world_sizes": "4"}, ((4,), "fp32", 2)),
    ({"precision": "bf16"}, ((2, 3), "bf16", 2)),
    ({"examples": 0}, ((2, 3), "fp32", 0)),
    ({"world_sizes": [1, 2, 3, 4], "precision": "both", "examples": 12}, ((2, 3), "fp32", 2)),
])
def test_an_option_given_with_another_value_than_its_default_wins_over_quick_s(
    given: dict[str, object], expected: tuple[tuple[int, ...], str, int]
) -> None:
    """--quick --battery-world-sizes 4 runs the quick scenarios at W=4; --precision bf16 in bf16; --battery-examples
    0 draws nothing; the defaults themselves (however written) leave --quick's choice."""
    options = BatteryOptions.parse(quick=True, **given)  # type: ignore[arg-type]
    assert expected == (options.world_sizes, options.precision, options.examples)
    assert {"uneven", "single", "one_empty"} >= {c.scenario for c in plan.session_cases(options)}


def test_without_quick_the_options_are_untouched() -> None:
    """No --quick: the defaults are the full battery's (W=1-4, both lanes, 12 drawn layouts), every scenario."""
    options = BatteryOptions.parse()
    assert ((1, 2, 3, 4), "both", 12, False) == (options.world_sizes, options.precision, options.examples,
                                                 options.quick)
    assert "all_empty" in {c.scenario for c in plan.session_cases(options)}


def test_the_command_line_and_pytest_parse_quick_into_the_same_options() -> None:
    """``battery --quick`` and pytest's ``--quick`` give one value; without it, another (the negative control)."""
    from harness.testing.plugin import options_from
    from harness.workflow.checks import battery_options
    from harness.workflow.cli import build_parser

    class Config:
        def __init__(self, quick: bool) -> None:
            self.quick = quick

        def getoption(self, name: str) -> object:
            defaults = build_parser().parse_args(["battery"])
            pytest_names = {"battery_world_sizes": "world_sizes", "battery_examples": "examples",
                            "battery_deadline": None, "battery_report": "json", "battery_skip": "skip",
                            "battery_quick": "quick", "find_unused_parameters": "find_unused_parameters"}
            if name == "battery_quick":
                return self.quick
            if name == "battery_deadline":
                return None
            return getattr(defaults, pytest_names.get(name) or name)

    cli = battery_options(build_parser().parse_args(["battery", "--quick"]))
    assert cli == options_from(Config(True)) == BatteryOptions.parse(quick=True)  # type: ignore[arg-type]
    assert cli != options_from(Config(False))  # type: ignore[arg-type]
