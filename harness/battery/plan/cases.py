"""The battery's plan: which check runs on which scenario, world size and precision.

One list, shared by the pytest lane (``harness/battery/test_battery.py`` parametrizes from it) and the command line
(``python -m harness battery``), so both judge a recipe on exactly the same cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import harness.battery.judge.checks  # noqa: F401  (the checks register themselves in REGISTRY when imported)
from harness.battery import mesh_scenarios, scenarios
from harness.battery.judge.registry import REGISTRY
from harness.battery.plan.options import (
    MAX_SCENARIO_WORLD_SIZE,
    PRECISION_CHOICES,
    WORLD_SIZES,
    BatteryOptions,
    check_world_sizes,
    parse_world_sizes,
    precisions,
    strategies,
)
from harness.battery.plan.selection import QUICK_SCENARIOS
from harness.core.mesh import Mesh


@dataclass(frozen=True)
class Case:
    check: str
    scenario: str
    world_size: int
    precision: str
    strategy: str = "ddp"
    mesh: Mesh | None = None
    """The mesh the case runs over (``--mesh``); None: ``dp=world_size``."""

    @property
    def id(self) -> str:
        return f"{self.scenario}-world{self.world_size}-{self.precision}" + (
            "" if self.strategy == "ddp" else f"-{self.strategy}") + (
            "" if self.mesh is None else "-" + self.mesh.stem)

    @property
    def run_key(self) -> str:
        """Cases with the same key share one launch."""
        return self.id


def cases(world_sizes: Sequence[int] = WORLD_SIZES, precision: str = "both",
          checks: Sequence[str] | None = None, strategy: str = "ddp", meshes: Sequence[Mesh] = ()) -> list[Case]:
    """Every case of the battery, in a stable order: by check (:data:`harness.battery.judge.registry.REGISTRY`'s order,
    each check where and in the precisions it registered for), then scenario, world size, strategy and precision."""
    lanes = precisions(precision)
    ways = strategies(strategy)
    worlds = check_world_sizes(world_sizes, "world_sizes", MAX_SCENARIO_WORLD_SIZE)  # options checked their own
    out = []
    for info in REGISTRY.values():  # the checks' order: the order they are defined in
        if checks is not None and info.name not in checks:
            continue
        layouts: list[tuple[int, Mesh | None]] = (
            [(m.world_size, m) for m in meshes] if meshes else [(w, None) for w in worlds])
        for scenario in (*scenarios.BATTERY_SCENARIOS, *mesh_scenarios.MESH_SCENARIOS):
            if not info.runs_on(scenario):
                continue
            for world, mesh in layouts:
                if scenario in mesh_scenarios.MESH_SCENARIOS and scenario not in mesh_scenarios.for_mesh(mesh):
                    continue  # a mesh scenario runs on the meshes it is written for
                if scenario in scenarios.MULTI_RANK_ONLY and (mesh.data_ranks if mesh else world) == 1:
                    continue  # one rank of one is every rank: that is the all_empty scenario
                out += [Case(info.name, scenario, world, p, s, mesh) for s in ways
                        for p in (lanes if info.per_precision else lanes[:1])]
    return out


def session_cases(options: BatteryOptions, checks: Sequence[str] | None = None) -> list[Case]:
    """The cases a battery session runs under ``options`` (its world sizes and precision lanes); under ``--quick``
    only those on :data:`harness.battery.plan.selection.QUICK_SCENARIOS` (its world sizes and precision are already the
    options')."""
    out = cases(options.world_sizes, options.precision, checks, options.strategy, options.meshes)
    return [c for c in out if c.scenario in QUICK_SCENARIOS] if options.quick else out


FIRST_LAYOUTS = 2
"""The layouts every drawn lane starts with (:func:`harness.battery.layouts.informative_layouts`)."""


@dataclass(frozen=True)
class DrawnLane:
    """One run of the drawn-layout lane: ``examples`` layouts, each judged in ``precision`` under ``strategy``, over
    ``mesh`` (its data ranks drawn; None: ``dp=W`` at the session's world sizes)."""

    precision: str
    strategy: str = "ddp"
    examples: int = 2
    mesh: Mesh | None = None

    @property
    def id(self) -> str:
        return f"drawn-{self.precision}-{self.strategy}" + ("" if self.mesh is None else f"-{self.mesh.stem}")


def drawn_lanes(options: BatteryOptions) -> list[DrawnLane]:
    """The drawn lane's runs under ``options``: one per precision lane, strategy and mesh the session asked for (the
    same lanes its cases run in), none when ``options.examples`` is 0.

    ``--battery-examples`` is the session's budget, shared over these runs (each gets its share, rounded up, and at
    least the two layouts chosen to tell mistakes apart): a drawn layout costs a launch in every lane, and a second
    lane would otherwise double the battery's drawn time while judging the same recipe code on the same shapes."""
    if options.examples == 0:
        return []
    meshes: list[Mesh | None] = list(options.meshes) or [None]
    lanes = [(p, s, m) for m in meshes for s in options.strategy_lanes for p in options.lanes]
    share = min(options.examples, max(FIRST_LAYOUTS, -(-options.examples // len(lanes))))
    return [DrawnLane(p, s, share, m) for p, s, m in lanes]


__all__ = ["PRECISION_CHOICES", "WORLD_SIZES", "BatteryOptions", "Case", "DrawnLane", "cases", "check_world_sizes",
           "drawn_lanes", "parse_world_sizes", "precisions", "session_cases"]
