"""A battery verdict: what one check says of one run, with the numbers behind it, and the constructors every check
and every reading of a failed run builds it with.

A verdict never raises. Its ``status`` is ``"pass"``, ``"fail"`` or ``"n/a"`` (the check means nothing here: there is
nothing to synchronize or agree on with one rank), or ``"skipped"`` (``--battery-skip``: the check ran, its verdict is
kept in ``skipped_status`` and its message, and does not count); a failure carries its ``cause``: ``"numbers"`` when
the check's own comparison failed, else how the run itself failed (``"desync"``, ``"crash"``, ``"died"``,
``"deadline"``, ``"refused"``). The battery's tests fail with ``verdict.message``; the negative-control tests require
the cause their control's mistake produces; the command line prints verdicts as a table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from harness.battery.launch.run import Run

PASS, FAIL, NOT_APPLICABLE, SKIPPED = "pass", "fail", "n/a", "skipped"


@dataclass(frozen=True)
class Verdict:
    check: str
    recipe: str
    scenario: str
    world_size: int
    precision: str
    status: str
    message: str
    cause: str | None = None
    max_error: float | None = None
    worst_ratio: float | None = None
    over_tolerance: int | None = None
    window: int | None = None
    finding: str | None = None
    """A named reading of the numbers: ``"float32_computation"`` when a float64 error sits at float32 scale."""
    notes: tuple[str, ...] = ()
    details: str | None = None
    """Every rank's whole report when the run failed (tracebacks, stacks), for ``-v``."""
    diagnosis: dict[str, object] | None = None
    """A failing parity verdict's diagnosis (:meth:`harness.battery.diagnose.of_run.Diagnosis.to_dict`): the effective
    weights, the signature they match and the per-parameter table."""
    label: str | None = None
    """The battery table's row for a verdict that is not one (scenario, world size, precision) case: the drawn
    lane's ``"drawn (12 layouts, W in 1,2,3,4, fp32)"`` (its ``world_size`` is 0: several). None: the case's row."""
    strategy: str = "ddp"
    """The data-parallel strategy the ranks ran under (``"ddp"``, ``"fsdp2"``)."""
    mesh: str | None = None
    """The mesh the ranks ran over (``"dp=2,cp=2"``, ``--mesh``); None: ``dp=W``."""
    fix: str | None = None
    """What to change in the recipe, in the words of the user's code, where a failure's cause is known (a parity
    failure's diagnosis, a missing ``no_sync``, a global generator moved); None: a pass, or a cause not read."""
    skip_reason: str | None = None
    """Why the user skipped this check (``--battery-skip CHECK=reason``); set only on a ``"skipped"`` verdict."""
    skipped_status: str | None = None
    """What a skipped verdict would have been (``"pass"``, ``"fail"``, ``"n/a"``): a skip never hides a failure."""

    @property
    def passed(self) -> bool:
        """True unless the check failed (a check that does not apply did not fail, nor did one the user skipped:
        ``status`` tells them apart, and a skipped verdict's ``skipped_status`` says what it would have been)."""
        return self.status != FAIL

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


def make_verdict(check: str, run: Run, status: str, detail: str, window: int | None = None,
                 **fields: object) -> Verdict:
    head = {PASS: "passed", FAIL: "FAILED", NOT_APPLICABLE: "not applicable"}[status]
    message = f"check {check} {head}: {run.label(window)}: {detail}"
    if status == FAIL and "cause" not in fields:
        fields["cause"] = "numbers"
    fields.setdefault("strategy", strategy(run))
    fields.setdefault("mesh", run.run_spec.layout.label if run.run_spec is not None and run.run_spec.layout else None)
    return Verdict(check, run.recipe, run.scenario, run.world_size, run.precision, status, message, window=window,
                   **fields)  # type: ignore[arg-type]


def passed(check: str, run: Run, detail: str, window: int | None = None, **fields: object) -> Verdict:
    return make_verdict(check, run, PASS, detail, window, **fields)


def failed(check: str, run: Run, detail: str, window: int | None = None, **fields: object) -> Verdict:
    return make_verdict(check, run, FAIL, detail, window, **fields)


def strategy(run: Run) -> str:
    return run.run_spec.strategy if run.run_spec is not None else "ddp"
