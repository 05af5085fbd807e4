"""The check registry: :func:`check` registers a check, and :data:`REGISTRY` and :data:`CHECKS` list every
registered one in definition order, with where it runs (:data:`SCENARIO_SETS`) and in which precisions.

The checks register themselves when :mod:`harness.battery.judge.checks` is imported; this module imports none of them,
so a reader of the registry imports that module too (:mod:`harness.battery.plan.cases` does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from harness.battery.judge.failed_runs import usage_error
from harness.battery.judge.verdict import FAIL, NOT_APPLICABLE, Verdict, make_verdict
from harness.battery.launch.run import Run

SCENARIO_SETS = ("with_tokens", "all_empty", "every")
"""Where a check runs: every scenario with supervised tokens (the default), only ``all_empty`` (no token anywhere in
the window), or every scenario."""


@dataclass(frozen=True)
class CheckInfo:
    """A registered check: its name, the function, whether it runs in every selected precision (the numbers depend on
    it) or in the first only, and where it runs (:data:`SCENARIO_SETS`)."""

    name: str
    fn: Callable[[Run], Verdict]
    per_precision: bool
    scenarios: str

    def runs_on(self, scenario: str) -> bool:
        if self.scenarios == "every":
            return True
        return (scenario == "all_empty") == (self.scenarios == "all_empty")


REGISTRY: dict[str, CheckInfo] = {}
"""Every check, in the order the battery reports them (the order :mod:`harness.battery.judge.checks` defines them
in)."""

CHECKS: dict[str, Callable[[Run], Verdict]] = {}
"""Every check by name, in :data:`REGISTRY`'s order (the plan, the command line and the controls' targets name them)."""


MODEL_REFUSED = "A property of the model, not of the recipe"
"""What the message of a case the model cannot run says (n/a with the model's own error before it)."""

def check(*, per_precision: bool = False, scenarios: str = "with_tokens") -> Callable[[Callable[[Run], Verdict]],
                                                                                       Callable[[Run], Verdict]]:
    """Register a check: the plan (:func:`harness.battery.plan.cases.cases`), the command line and the pytest lane find
    it here, in definition order. What every check does around its own comparison: a case the model cannot run is n/a
    with the model's own error; a recipe that broke the contract so that nothing can be judged is a usage error; what
    the harness found about the model (:attr:`Run.notes`) travels with the verdict, and a failure's message ends with
    it."""
    if scenarios not in SCENARIO_SETS:
        msg = f"scenarios={scenarios!r} must be one of {', '.join(SCENARIO_SETS)}"
        raise ValueError(msg)

    def register(fn: Callable[[Run], Verdict]) -> Callable[[Run], Verdict]:
        name = fn.__name__
        if name in REGISTRY:
            msg = f"a check named {name!r} is already registered ({REGISTRY[name].fn.__module__}); pick another name"
            raise ValueError(msg)

        @functools.wraps(fn)
        def judged(run: Run) -> Verdict:
            if run.model_error is not None:
                return make_verdict(name, run, NOT_APPLICABLE, f"{run.model_error}. {MODEL_REFUSED}: this case is "
                                    "not judged on this model (docs/your-model.md says what a model must allow)",
                                    notes=run.notes)
            verdict = usage_error(name, run) or fn(run)
            if not run.notes:
                return verdict
            message = verdict.message
            if verdict.status == FAIL:
                message += "".join(f"\n  model: {n}" for n in run.notes)
            return replace(verdict, message=message, notes=verdict.notes + run.notes)

        REGISTRY[name] = CheckInfo(name, judged, per_precision, scenarios)
        CHECKS[name] = judged
        return judged

    return register
