"""The battery as a table: every check for every recipe, run without pytest (the command line's ``battery``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from harness.battery import checks, runner
from harness.battery.checks import Verdict


@dataclass(frozen=True)
class Row:
    """One check of the table: which verdict function, on which scenario and precision."""

    check: str
    scenario: str
    precision: str
    judge: Callable[[runner.Run], Verdict]

    def title(self, world_size: int) -> str:
        return f"{self.check} ({self.scenario}, W={world_size}, {self.precision})"


ROWS = (
    Row("parity", "uneven", "fp32", checks.parity),
    Row("parity", "uneven", "fp64", checks.parity),
    Row("parity", "balanced", "fp32", checks.parity),
    Row("parity", "consecutive", "fp32", checks.parity),
    Row("parity", "short_final", "fp32", checks.parity),
    Row("parity", "one_empty", "fp32", checks.parity),
    Row("empty_window", "all_empty", "fp32", checks.empty_window),
    Row("ranks_agree", "consecutive", "fp32", checks.ranks_agree),
    Row("one_sync", "short_final", "fp32", checks.one_sync),
    Row("logged_loss", "consecutive", "fp32", checks.logged_loss),
    Row("hygiene", "uneven", "fp32", checks.hygiene),
)


def run_table(recipes: Sequence[str], world_sizes: Sequence[int], deadline: float,
              progress: Callable[[str], None] | None = None) -> list[Verdict]:
    verdicts = []
    for recipe in recipes:
        for world in world_sizes:
            for row in ROWS:
                if row.scenario == "one_empty" and world == 1:
                    continue  # one rank of one is every rank: that is the empty_window check
                if progress:
                    progress(f"{recipe.split(':')[-1]}: {row.title(world)}")
                run = runner.run(recipe, row.scenario, world, row.precision, deadline=deadline)
                verdicts.append(row.judge(run))
    return verdicts


def format_table(verdicts: Sequence[Verdict]) -> str:
    """Rows are checks, columns recipes; a cell is PASS/FAIL with the max error where there is one."""
    recipes = list(dict.fromkeys(v.recipe for v in verdicts))
    keys = list(dict.fromkeys((v.check, v.scenario, v.world_size, v.precision) for v in verdicts))
    cell = {(v.recipe, (v.check, v.scenario, v.world_size, v.precision)): v for v in verdicts}
    names = [r.split(":")[-1] for r in recipes]
    first = max(len(f"{c} ({s}, W={w}, {p})") for c, s, w, p in keys)
    widths = [max(len(n), 17) for n in names]
    lines = [" | ".join(["check".ljust(first), *(n.ljust(w) for n, w in zip(names, widths))])]
    lines.append("-+-".join(["-" * first, *("-" * w for w in widths)]))
    for key in keys:
        c, s, w, p = key
        parts = [f"{c} ({s}, W={w}, {p})".ljust(first)]
        for recipe, width in zip(recipes, widths):
            v = cell.get((recipe, key))
            if v is None:
                parts.append("".ljust(width))
                continue
            text = "PASS" if v.passed else "FAIL"
            if v.max_error is not None:
                text += f" {v.max_error:.1e}"
            elif not v.passed and "the run" in v.message:
                text += " (run failed)"
            parts.append(text.ljust(width))
        lines.append(" | ".join(parts))
    return "\n".join(lines)
