"""A run's fixes: :func:`harness.diagnosis.fixes.fix_for` and :func:`~harness.diagnosis.fixes.check_fix` in the words
of the run's own strategy, declared objective and mesh, for the diagnosis (:attr:`Diagnosis.fix`) and the failing
verdicts of :mod:`harness.battery.judge.checks`."""

from __future__ import annotations

from harness.battery.launch.run import Run
from harness.diagnosis.fixes import check_fix, fix_for


def run_forms(run: Run) -> dict[str, object]:
    """The keywords of :func:`~harness.diagnosis.fixes.fix_for` for ``run``: its strategy, objective and mesh."""
    strategy = run.run_spec.strategy if run.run_spec is not None else "ddp"
    return {"strategy": strategy, "objective": run.objective.name, "mesh": run.mesh}


def reading_fix(reading: object, run: Run) -> str:
    """The fix of a reading (a diagnosis, a Signature, a name) of ``run``."""
    return fix_for(reading, **run_forms(run))  # type: ignore[arg-type]


def verdict_fix(check: str, run: Run, finding: str | None = None) -> str:
    """The fix of ``check``'s failing verdict on ``run`` where no diagnosis reads it (``finding``: the verdict's)."""
    return check_fix(check, finding=finding, **run_forms(run))  # type: ignore[arg-type]


__all__ = ["reading_fix", "run_forms", "verdict_fix"]
