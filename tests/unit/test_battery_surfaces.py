"""What the battery's two surfaces (pytest and ``python -m harness battery``) promise the same way: ``--examples 0`` /
``--battery-examples 0`` means no drawn layouts, the world sizes narrow the drawn layouts too, the table's columns are
the recipes' names with one drawn row per run, and ``explain`` names its files after module and attribute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given

from harness.battery.judge.verdict import FAIL, PASS, Verdict
from harness.battery.layouts import Layout, layouts, shrink
from harness.battery.plan.options import BatteryOptions
from harness.battery.report.table import format_table, recipe_names
from harness.testing.hypothesis_profiles import load_profile
from harness.workflow.cli import main
from harness.workflow.explain import _stem

load_profile()

ROOT = Path(__file__).resolve().parents[2]
CORRECT = "harness.recipes:global_token_mean"


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_battery_examples_0_skips_the_drawn_test_with_its_reason() -> None:
    """pytest --battery-examples 0: the drawn-layout test is skipped, saying why, not failed."""
    done = _pytest("harness/battery/test_drawn_layouts.py", "-m", "recipe", "--battery-examples", "0")
    assert 0 == done.returncode, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--battery-examples 0: no drawn layouts" in done.stdout


def test_a_negative_number_of_examples_is_a_usage_error_on_both_surfaces(capsys: pytest.CaptureFixture[str]) -> None:
    """--battery-examples -1 is pytest's exit 4; --examples -1 the command line's exit 2; both say what 0 means."""
    done = _pytest("harness/battery/test_drawn_layouts.py", "-m", "recipe", "--battery-examples", "-1")
    assert 4 == done.returncode, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--battery-examples=-1 must be 0 (no drawn layouts) or a positive number" in done.stderr
    assert 2 == main(["battery", "--recipe", CORRECT, "--battery-examples", "-1"])
    assert "--battery-examples=-1 must be 0 (no drawn layouts) or a positive number" in capsys.readouterr().err


def test_an_old_option_name_still_works_and_says_which_name_to_use(capsys: pytest.CaptureFixture[str]) -> None:
    """--examples is the deprecated alias of --battery-examples: the same check, and a note naming the new name."""
    assert 2 == main(["battery", "--recipe", CORRECT, "--examples", "-1"])
    said = capsys.readouterr().err
    assert "note: --examples is deprecated; use --battery-examples" in said
    assert "--battery-examples=-1 must be 0" in said


@given(layouts(world_sizes=(2, 3)))
def test_drawn_layouts_take_their_world_size_from_the_chosen_ones(layout: Layout) -> None:
    """--world-sizes 2,3: no drawn layout has one rank or four."""
    assert layout.world_size in (2, 3)


def test_shrinking_keeps_the_world_size_among_the_chosen_ones() -> None:
    """A failing W=2 layout does not shrink to W=1 when the world sizes are 2 and 3."""
    layout = Layout(2, (((((5, 1),),), (((6, 2),),)),))  # one window; each rank one microbatch of one row
    small, _ = shrink(layout, lambda lay: True, world_sizes=(2, 3))
    assert 2 == small.world_size
    assert 1 == shrink(layout, lambda lay: True)[0].world_size


def _verdict(recipe: str, status: str = PASS, check: str = "parity", label: str | None = None) -> Verdict:
    return Verdict(check, recipe, "drawn" if label else "uneven", 0 if label else 2, "fp32", status,
                   f"check {check}", label=label)


def test_table_columns_are_the_recipes_names() -> None:
    """A recipe's column is its name attribute, not the last part of its import path."""
    header = format_table([_verdict(CORRECT), _verdict("user_recipes.variants:ClassRecipe")]).splitlines()[0]
    assert ["check", "global_token_mean", "class_recipe"] == [c.strip() for c in header.split("|")]


def test_recipes_sharing_a_name_get_their_module_then_their_path() -> None:
    """Same name in two modules: the module is appended; same name in one module: the whole path."""
    assert {
        CORRECT: "global_token_mean (harness.recipes)",
        "harness.recipes.correct:global_token_mean": "global_token_mean (harness.recipes.correct)",
        "user_recipes.slow:first_window": "user_recipes.slow:first_window",
        "user_recipes.slow:second_window": "user_recipes.slow:second_window",
    } == recipe_names([CORRECT, "harness.recipes.correct:global_token_mean", "user_recipes.slow:first_window",
                       "user_recipes.slow:second_window"])


def test_a_passing_and_a_failing_drawn_verdict_share_one_row() -> None:
    """The drawn lane is one row per run, labeled by its budget and world sizes, whatever each recipe's outcome."""
    label = "drawn (12 layouts, W in 2,3, fp32, ddp)"
    table = format_table([_verdict(CORRECT, PASS, "drawn", label),
                          _verdict("user_recipes.variants:ClassRecipe", FAIL, "drawn", label)])
    rows = [ln for ln in table.splitlines() if ln.startswith("drawn")]
    assert 1 == len(rows) and label in rows[0] and "PASS" in rows[0] and "FAIL" in rows[0]
    assert "W=0" not in table


def test_explain_files_carry_the_module_and_the_attribute() -> None:
    """Two modules' :recipe give two file names."""
    assert "explain-pkg.a-recipe-uneven-W2-fp32" == _stem("pkg.a:recipe", "uneven", 2, "fp32")
    assert _stem("pkg.a:recipe", "uneven", 2, "fp32") != _stem("pkg.b:recipe", "uneven", 2, "fp32")


def _fake_judge(seen: list[tuple[int, float]], fail_at: int | None = None, options: list[str] | None = None
                ) -> object:
    def judge(recipe: str, layout: Layout, battery: BatteryOptions, precision: str = "fp32",
              strategy: str | None = None, mesh: object = None) -> list[Verdict]:
        seen.append((layout.world_size, battery.deadline))
        if options is not None:
            options.append(battery.find_unused)
        if layout.world_size == fail_at:
            return [Verdict("parity", recipe, "drawn", layout.world_size, "fp32", FAIL, "parity off", cause="numbers")]
        return []

    return judge


def test_the_drawn_lane_launches_with_the_given_deadline_and_world_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """drawn_verdict passes deadline to every launch and draws only the given world sizes; its row says both."""
    import harness.battery.layouts as lay

    seen: list[tuple[int, float]] = []
    options: list[str] = []
    monkeypatch.setattr(lay, "judge_layout", _fake_judge(seen, options=options))
    verdict = lay.drawn_verdict(CORRECT, BatteryOptions.parse(examples=6, deadline=120.0, world_sizes="2,3",
                                                              find_unused="off"), derandomize=True)
    assert (PASS, 0, "drawn (6 layouts, W in 2,3, fp32, ddp)") == (verdict.status, verdict.world_size,
                                                                   verdict.label)
    assert seen and {d for _, d in seen} == {120.0} and {w for w, _ in seen} <= {2, 3}
    assert {"off"} == set(options)  # --find-unused-parameters reaches the drawn lane too


def test_a_failing_drawn_verdict_keeps_the_row_and_names_the_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failing layout's world size is in the message; the verdict's row is the passing one's."""
    import harness.battery.layouts as lay

    monkeypatch.setattr(lay, "judge_layout", _fake_judge([], fail_at=3))
    verdict = lay.drawn_verdict(CORRECT, BatteryOptions(examples=20, world_sizes=(2, 3)), derandomize=True)
    assert (FAIL, 0, "drawn (20 layouts, W in 2,3, fp32, ddp)") == (verdict.status, verdict.world_size,
                                                                    verdict.label)
    assert "a drawn layout at W=3 fails parity" in verdict.message


def test_the_command_line_gives_the_drawn_lane_its_deadline_and_world_sizes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """python -m harness battery --deadline 120 --world-sizes 2,3: the drawn lane gets both."""
    import harness.battery.layouts as lay
    import harness.battery.report.table as table

    calls: list[BatteryOptions] = []

    def drawn(recipe: str, options: BatteryOptions, derandomize: bool = False, **lane: str) -> Verdict:
        calls.append(options)
        return _verdict(recipe, PASS, "drawn", f"drawn (2 layouts, W in 2,3, {lane['precision']}, {lane['strategy']})")

    monkeypatch.setattr(table, "run_cases", lambda *args, **kwargs: [])
    monkeypatch.setattr(lay, "drawn_verdict", drawn)
    assert 0 == main(["battery", "--recipe", CORRECT, "--battery-world-sizes", "2,3", "--battery-examples", "2",
                      "--battery-deadline", "120", "-v"])  # -v: every row, the passing drawn rows included
    assert 2 == len(calls)  # --precision both: the float32 and the float64 lane
    assert (120.0, (2, 3), 2) == (calls[0].deadline, calls[0].world_sizes, calls[0].examples)
    out = capsys.readouterr().out
    assert "drawn (2 layouts, W in 2,3, fp32, ddp)" in out and "drawn (2 layouts, W in 2,3, fp64, ddp)" in out
