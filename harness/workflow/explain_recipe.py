"""``explain``'s recipe-level diagnosis: the battery's quick scenarios at the explained world size (and the scenario
explained), in every lane explained, judged by the battery's checks, and read together as the battery's last screen
reads them (:mod:`harness.battery.report.recipe_cause`), so that ``explain`` and the battery state the same cause."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from harness.battery.judge.verdict import Verdict
from harness.core.mesh import Mesh


def scenarios_for(scenario: str, world_size: int, layout: Mesh | None = None) -> list[str]:
    """The scenarios read: ``scenario``, then the battery's quick ones that run at this world size and mesh."""
    from harness.battery import mesh_scenarios, scenarios
    from harness.battery.plan.selection import QUICK_SCENARIOS

    out = [scenario]
    for name in QUICK_SCENARIOS:
        if name in out:
            continue
        if name in scenarios.MULTI_RANK_ONLY and (layout.data_ranks if layout else world_size) == 1:
            continue
        if layout is not None and name in mesh_scenarios.MESH_SCENARIOS and name not in mesh_scenarios.for_mesh(layout):
            continue
        out.append(name)
    return out


def verdicts(args: argparse.Namespace, model: str | None, lanes: Sequence[tuple[str, str]]) -> list[Verdict]:
    """Every check's verdict on each scenario of :func:`scenarios_for` in each lane (the runs are the battery's,
    cached: the explained one is not launched again)."""
    import harness.battery.judge.checks  # noqa: F401  (the checks register themselves in REGISTRY when imported)
    from harness.battery.judge.registry import REGISTRY
    from harness.battery.launch import runner
    from harness.battery.plan.options import RunSpec

    out = []
    for strategy, precision in lanes:
        for scenario in scenarios_for(args.scenario, args.world_size, getattr(args, "layout", None)):
            spec = RunSpec(args.recipe, scenario, args.world_size, precision, model=model,
                           batch_format=args.batch_format, strategy=strategy, deadline=args.deadline,
                           objective=args.objective, layout=getattr(args, "layout", None),
                           chunking=getattr(args, "cp_chunking", "contiguous"),
                           pp_schedule=getattr(args, "pp_schedule", "gpipe"), pp_steps=getattr(args, "pp_steps", 1),
                           pp_microbatches=getattr(args, "pp_microbatches", 2))
            run = runner.run(spec)
            out += [info.fn(run) for info in REGISTRY.values() if info.runs_on(scenario)]
    return out


def recipe_level(args: argparse.Namespace, model: str | None, lanes: Sequence[tuple[str, str]]) -> list[str]:
    """The recipe-level diagnosis's lines (none when every case passes), headed by what was read."""
    from harness.battery.report.recipe_cause import recipe_lines

    said = recipe_lines(verdicts(args, model, lanes))
    if not said:
        return []
    where = ", ".join(scenarios_for(args.scenario, args.world_size, getattr(args, "layout", None)))
    return [f"over the battery's quick scenarios ({where}) at W={args.world_size}, in "
            f"{', '.join(f'{s}/{p}' for s, p in lanes)}:", *said]


__all__ = ["recipe_level", "scenarios_for", "verdicts"]
