"""The catalog cannot drift: every negative control, judged by every check on its target's scenario and the battery's
quick scenarios (at its first world size, in its target's precision, strategy, batch format, objective and mesh),
reads its declared signature at the recipe level (:mod:`harness.diagnosis.recipe_level`): the one cause its failing
cases share, or one its cases cannot tell from it. A control whose mistake no case diagnoses (its target is another
check than parity, or it ends in a desync) is read by its target check's own failure.

A control that declares no signature (or ``correct``: parity passes on its target) must fail its target check and get
one cause; one whose declared reading no case gives (its gradient is right on these scenarios: a weight decay after
backward) is read by its target check's failure. ``KNOWN`` would name a control whose cases do not all fit one
hypothesis, with what disagrees, as a strict expected failure (none does today: a new control that does not read its
own cause fails here, or is listed with its reason). ``benchmarks/recipe_readings.py`` measures the whole catalog on
the full battery, with its lines.
"""

from __future__ import annotations

import pytest
from support.groups import control_group

import harness.battery.judge.checks  # noqa: F401  (the checks register themselves when imported)
from harness.battery.judge.registry import REGISTRY
from harness.battery.launch import runner
from harness.battery.plan.options import BatteryOptions
from harness.battery.report.recipe_cause import names_its_cause, readings
from harness.core.mesh import Mesh
from harness.recipes import CONTROLS, DIAGNOSES
from harness.recipes.catalog import IN_PROCESS, unavailable
from harness.workflow.explain_recipe import scenarios_for

KNOWN: dict[str, str] = {}


def _cases() -> list[object]:
    out = []
    for name, t in CONTROLS.items():
        # With the negative-control test of the same world: its target run is this test's first (one launch).
        world = Mesh.parse(t.mesh).world_size if t.mesh else (t.world_sizes or (2,))[0]
        marks = [pytest.mark.slow, pytest.mark.xdist_group(control_group(name, world))]
        if t.launch != IN_PROCESS:
            marks.append(pytest.mark.skip(reason=f"its target needs launch={t.launch!r}: ranks on several nodes"))
        if unavailable(t) is not None:
            marks.append(pytest.mark.skip(reason=str(unavailable(t))))
        if name in KNOWN:
            marks.append(pytest.mark.xfail(reason=KNOWN[name], strict=True))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _cases())
def test_each_control_reads_its_own_cause_at_the_recipe_level(name: str) -> None:
    t = CONTROLS[name]
    mesh = Mesh.parse(t.mesh) if t.mesh else None
    world = mesh.world_size if mesh else (t.world_sizes or (2,))[0]
    options = BatteryOptions(world_sizes=(world,))
    verdicts = []
    for scenario in scenarios_for(t.scenario, world, mesh):
        run = runner.run(options.spec(f"harness.recipes:{name}", scenario, world, t.precision,
                                      batch_format=t.batch_format, strategy=t.strategy, objective=t.objective,
                                      mesh=mesh, model=t.model))
        verdicts += [info.fn(run) for info in REGISTRY.values() if info.runs_on(scenario)]
    read = readings(verdicts).get(f"harness.recipes:{name}")
    assert read is not None, f"{name} fails no check on {scenarios_for(t.scenario, world, mesh)} at W={world}"
    assert names_its_cause(read, DIAGNOSES[name], t.check, t.shows_as), "\n".join(read.lines())
