"""A recipe's forward under autocast: the rank records it with where the recipe entered it, and the table says it once
under an n/a row (the float64 lane cannot judge such a recipe); one process, no ranks."""

from __future__ import annotations

import torch

from harness.battery.judge.verdict import NOT_APPLICABLE, Verdict
from harness.battery.rank.rank_watch import AutocastSeen
from harness.battery.report.table import format_table

RECIPE = "user_recipes.loops:BF16Autocast"


def _seen(autocast: bool) -> str | None:
    with torch.random.fork_rng(devices=[]):  # the suite's global generator stays as found
        model = torch.nn.Linear(4, 4)
    seen = AutocastSeen("cpu")
    model.register_forward_pre_hook(seen)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(torch.zeros(2, 4))  # the line the record names
    return seen.seen


def test_autocast_at_the_model_is_recorded_with_the_line_that_called_the_model() -> None:
    """The dtype, and this file's line of the model call (the first frame outside torch and the harness)."""
    seen = _seen(True)
    assert seen is not None and seen.startswith("cpu torch.bfloat16, entered around the model call at ")
    assert "test_autocast_note.py:" in seen and seen.endswith(" in _seen")


def test_a_forward_without_autocast_records_nothing() -> None:
    """The control: the same call with autocast disabled."""
    assert _seen(False) is None


def _na(scenario: str, finding: str | None) -> Verdict:
    why = "the recipe's forward runs under autocast (cpu torch.bfloat16, entered around the model call at x.py:3)"
    return Verdict("parity", RECIPE, scenario, 2, "fp64", NOT_APPLICABLE,
                   f"check parity not applicable: recipe {RECIPE}, world 2, fp64, scenario {scenario}: {why}",
                   finding=finding)


def test_an_autocast_n_a_is_explained_once_under_the_table_for_all_its_cases() -> None:
    """Two cases n/a for the same reason: one note naming the first case, the count of the others, and the autocast
    with where it was entered."""
    notes = [ln for ln in format_table([_na("uneven", "autocast"), _na("long", "autocast")]).splitlines()
             if ln.startswith("  note:")]
    assert ["  note: bf16_autocast, n/a in parity (uneven, W=2, fp64) and 1 more: the recipe's forward runs under "
            "autocast (cpu torch.bfloat16, entered around the model call at x.py:3)"] == notes


def test_an_n_a_without_a_finding_adds_no_note() -> None:
    """The control: a check that does not apply for a reason of the battery's own (no finding) stays a bare n/a."""
    assert "note:" not in format_table([_na("uneven", None)])
