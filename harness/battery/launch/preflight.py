"""The pre-flight: the recipe once on the smallest case before the matrix, so that a recipe that raises stops the
battery within seconds with one message, not the same traceback from every case.

The smallest case is the session's smallest world size on ``uneven`` (else its first scenario there), in the first
precision lane, strategy and mesh of the session. It runs through :func:`harness.battery.launch.runner.run`, whose
cache the matrix shares: a recipe that passes the pre-flight is not launched twice for that case.
``--battery-keep-going`` (:data:`harness.battery.plan.options.KEEP_GOING_HELP`) runs the matrix anyway.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from harness.battery.judge.crash_report import read_crash
from harness.battery.launch import runner
from harness.battery.launch.run import Run
from harness.battery.plan import cases as plan
from harness.battery.plan.options import BatteryOptions

PREFERRED = "uneven"
"""The scenario the pre-flight prefers: every rank has tokens, with windows of several microbatches."""

USAGE = "ContractViolation:"


def smallest(cases: Sequence[plan.Case]) -> plan.Case | None:
    """The case the pre-flight runs: the smallest world size, ``uneven`` there if the session has it."""
    if not cases:
        return None
    least = min(c.world_size for c in cases)
    first = [c for c in cases if c.world_size == least]
    return next((c for c in first if c.scenario == PREFERRED), first[0])


def preflight(recipe: str, cases: Sequence[plan.Case], options: BatteryOptions, *, probe: bool = False) -> str | None:
    """Run ``recipe`` on :func:`smallest` of ``cases``; None when no rank raised, else the one message that says
    which exception, on which rank, where in the user's code, and the known fix. ``probe``: the model's probe runs
    first, in the case's preparation (:class:`~harness.model.ModelError` when the model cannot be used)."""
    case = smallest(cases)
    if case is None:
        return None
    run = runner.run(options.spec(recipe, case.scenario, case.world_size, case.precision, strategy=case.strategy,
                                  mesh=case.mesh), probe=probe)
    mesh = "" if case.mesh is None else f", mesh {case.mesh.label}"
    world = case.mesh.world_size if case.mesh is not None else case.world_size
    where = f"in the pre-flight (its first case: {case.scenario}, W={case.world_size}, {case.precision}, " \
            f"{case.strategy}{mesh})"
    crash = read_crash(run.failure)
    if crash is None:
        refused = _refused(run)  # a ValueError is a window refused: on one with tokens, the same stop
        if refused is None:
            return None  # a usage error, a death or a deadline: the matrix's verdicts say those as they always have
        rank, k, error = refused
        lines = [f"the recipe {recipe} raised {where}, on rank {rank} of {world} in window {k}, a window with "
                 f"supervised tokens (a recipe may refuse only a window without any):", f"  {error}"]
    elif crash.exception.split(":", 1)[0].endswith("ContractViolation"):
        return None
    else:
        lines = [f"the recipe {recipe} raised {where}, on rank {crash.rank} of {world}:", *crash.lines()]
    return "\n".join([*lines, "no other case was run: fix the recipe, or pass --battery-keep-going to run every case "
                      "anyway"])


def _refused(run: Run) -> tuple[int, int, str] | None:
    """The first rank and window where the recipe raised ValueError on a window with supervised tokens."""
    for rank, records in enumerate(run.records or ()):
        for k, rec in enumerate(records):
            if rec.error is not None and run.references[k] is not None:
                return rank, k, rec.error
    return None


def session_preflight(recipe: str, options: BatteryOptions) -> str | None:
    """:func:`preflight` on the cases a battery session runs under ``options`` (pytest's, torchrun's)."""
    return preflight(recipe, plan.session_cases(options), options)


BATTERY_CASE_ID = re.compile(r"(?:battery/test_battery\.py::|battery/test_drawn_layouts\.py::|\[[a-z_]+-world\d+-)")
"""A pytest node id of a battery test: its file, or a parameter that is a case's
:attr:`~harness.battery.plan.cases.Case.id` (``[uneven-world2-fp32]``; under ``--pyargs`` from outside the package an
id has no file). An xdist controller sees only the ids its workers collected."""
