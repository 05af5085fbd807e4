"""The battery's plan: which check runs on which scenario, world size and precision.

One list, shared by the pytest lane (``harness/battery/test_battery.py`` parametrizes from it) and the command line
(``python -m harness battery``), so both judge a recipe on exactly the same cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.battery import scenarios

WORLD_SIZES = (1, 2, 3, 4)
"""World sizes every recipe runs at: 1 is the sanity lane, 2-4 the data-parallel ones."""

PRECISION_CHOICES = {"fp32": ("fp32",), "fp64": ("fp64",), "both": ("fp32", "fp64")}
"""``--precision``: the float32 lane (tolerances atol 1e-6, rtol 1e-4), the strict float64 lane, or both."""

NUMERIC_CHECKS = ("parity", "hygiene")
"""Checks that run in every selected precision (the gradient and its dtype depend on it)."""

ONCE_CHECKS = ("one_sync", "ranks_agree", "logged_loss", "weights_unchanged")
"""Checks that run in the first selected precision only (a synchronization count does not depend on it)."""


@dataclass(frozen=True)
class Case:
    check: str
    scenario: str
    world_size: int
    precision: str

    @property
    def id(self) -> str:
        return f"{self.scenario}-world{self.world_size}-{self.precision}"

    @property
    def run_key(self) -> str:
        """Cases with the same key share one launch."""
        return self.id


def parse_world_sizes(text: str, option: str = "--battery-world-sizes") -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``, validated; ValueError naming the option and the fix otherwise."""
    try:
        worlds = [int(w) for w in str(text).split(",")]
    except ValueError:
        msg = f"{option}={text!r} must be comma-separated world sizes from 1 to {scenarios.MAX_WORLD_SIZE}, e.g. 1,2"
        raise ValueError(msg) from None
    return check_world_sizes(worlds, option)


def check_world_sizes(world_sizes: Sequence[int], option: str = "--battery-world-sizes") -> tuple[int, ...]:
    """Validate world sizes against what the scenarios can be built for."""
    bad = [w for w in world_sizes if isinstance(w, bool) or not isinstance(w, int)
           or not 1 <= w <= scenarios.MAX_WORLD_SIZE]
    if bad or not world_sizes:
        msg = (f"{option}={','.join(map(str, world_sizes))!r} must be world sizes between 1 and "
               f"{scenarios.MAX_WORLD_SIZE}, e.g. 1,2,3,4")
        raise ValueError(msg)
    return tuple(dict.fromkeys(world_sizes))


def precisions(choice: str, option: str = "--precision") -> tuple[str, ...]:
    if choice not in PRECISION_CHOICES:
        msg = f"{option}={choice!r} must be one of {', '.join(PRECISION_CHOICES)}"
        raise ValueError(msg)
    return PRECISION_CHOICES[choice]


def cases(world_sizes: Sequence[int] = WORLD_SIZES, precision: str = "both",
          checks: Sequence[str] | None = None) -> list[Case]:
    """Every case of the battery, in a stable order (by check, then scenario, world size and precision)."""
    lanes = precisions(precision)
    worlds = check_world_sizes(world_sizes)
    out = []
    for scenario in scenarios.BATTERY_SCENARIOS:
        for world in worlds:
            if scenario in scenarios.MULTI_RANK_ONLY and world == 1:
                continue  # one rank of one is every rank: that is the all_empty scenario
            if scenario == "all_empty":
                out.append(Case("empty_window", scenario, world, lanes[0]))
                out.append(Case("weights_unchanged", scenario, world, lanes[0]))
                continue
            out += [Case(c, scenario, world, p) for c in NUMERIC_CHECKS for p in lanes]
            out += [Case(c, scenario, world, lanes[0]) for c in ONCE_CHECKS]
    order = ("parity", "one_sync", "ranks_agree", "logged_loss", "hygiene", "empty_window", "weights_unchanged")
    out.sort(key=lambda c: order.index(c.check))
    return [c for c in out if checks is None or c.check in checks]
