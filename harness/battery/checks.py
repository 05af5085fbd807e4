"""The battery's checks: each turns a :class:`~harness.battery.runner.Run` into a verdict with the numbers behind it.

A verdict never raises. Its ``status`` is ``"pass"``, ``"fail"`` or ``"n/a"`` (the check means nothing here: there is
nothing to synchronize or agree on with one rank); a failure carries its ``cause``: ``"numbers"`` when the check's own
comparison failed, else how the run itself failed (``"desync"``, ``"crash"``, ``"died"``, ``"deadline"``,
``"refused"``). The battery's tests fail with ``verdict.message``; the negative-control tests require the cause their
control's mistake produces; the command line prints verdicts as a table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from harness.battery.diagnose import diagnose, worst
from harness.battery.runner import Run, token_mean_at
from harness.core.compare import compare, max_abs_difference, tolerances

PASS, FAIL, NOT_APPLICABLE = "pass", "fail", "n/a"
_KIND_CAUSE = {"raised": "crash", "died": "died", "deadline": "deadline", "desync": "desync"}


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
    """A failing parity verdict's diagnosis (:meth:`harness.battery.diagnose.Diagnosis.to_dict`): the effective
    weights, the signature they match and the per-parameter table."""

    @property
    def passed(self) -> bool:
        """True unless the check failed (a check that does not apply did not fail; ``status`` tells them apart)."""
        return self.status != FAIL

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


def _verdict(check: str, run: Run, status: str, detail: str, window: int | None = None, **fields: object) -> Verdict:
    head = {PASS: "passed", FAIL: "FAILED", NOT_APPLICABLE: "not applicable"}[status]
    message = f"check {check} {head}: {run.label(window)}: {detail}"
    if status == FAIL and "cause" not in fields:
        fields["cause"] = "numbers"
    return Verdict(check, run.recipe, run.scenario, run.world_size, run.precision, status, message, window=window,
                   **fields)  # type: ignore[arg-type]


def _passed(check: str, run: Run, detail: str, window: int | None = None, **fields: object) -> Verdict:
    return _verdict(check, run, PASS, detail, window, **fields)


def _failed(check: str, run: Run, detail: str, window: int | None = None, **fields: object) -> Verdict:
    return _verdict(check, run, FAIL, detail, window, **fields)


def crash_summary(text: str) -> list[str]:
    """The lines of a rank's report a reader needs: the innermost frame and the exception line, never the caret
    underline that Python 3.11 puts between them."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not set(ln.strip()) <= set("^~ ")]
    if not lines:
        return ["(nothing reported)"]
    frames = [ln.strip() for ln in lines if ln.lstrip().startswith('File "')]
    return [*frames[-1:], lines[-1].strip()]


def _failed_run(check: str, run: Run) -> Verdict | None:
    if run.failure is None:
        return None
    err = run.failure
    what = {"deadline": "hung past the deadline", "died": "lost a rank", "raised": "crashed",
            "desync": "left its ranks out of step"}.get(err.kind, err.kind)
    lines = [str(err).splitlines()[0]]
    for i, rank in enumerate(err.ranks):
        detail = err.details.get(rank, "")
        if i == 0:
            lines += [f"  rank {rank}: {ln}" for ln in crash_summary(detail)]
        else:
            # A peer's faulthandler stack starts with its newest frame: where it was stuck.
            stack = [ln.strip() for ln in detail.splitlines() if ln.strip()]
            lines += [f"  rank {rank}: {ln}" for ln in stack[:3]]
    return _failed(check, run, f"the run {what}: " + "\n".join(lines), cause=_KIND_CAUSE.get(err.kind, err.kind),
                   details=str(err))


def _unexpected_error(check: str, run: Run) -> Verdict | None:
    assert run.records is not None
    for rank, records in enumerate(run.records):
        for k, rec in enumerate(records):
            if rec.error is not None and run.references[k] is not None:
                return _failed(check, run, f"rank {rank} raised {rec.error} on a window with supervised tokens", k,
                               cause="refused")
    return None


def _broken(check: str, run: Run) -> Verdict | None:
    return _failed_run(check, run) or _unexpected_error(check, run)


def _single_rank(check: str, run: Run, why: str) -> Verdict | None:
    if run.world_size == 1:
        return _verdict(check, run, NOT_APPLICABLE, why)
    return None


def parity(run: Run) -> Verdict:
    """Every rank's synchronized gradient equals the single-device reference, window by window."""
    bad = _broken("parity", run)
    if bad:
        return bad
    assert run.records is not None
    picked = worst(run)
    assert picked is not None
    k, rank = picked
    ref = run.references[k]
    assert ref is not None
    c = compare(run.records[rank][k].grad, ref.gradient)  # type: ignore[arg-type]
    numbers = {"max_error": c.max_abs_error, "worst_ratio": c.worst_ratio, "over_tolerance": c.over_tolerance}
    detail = f"worst on rank {rank}: {c.summary()}"
    if c.passed:
        return _passed("parity", run, detail, window=k, **numbers)
    finding = None
    if run.precision == "fp64":
        atol, rtol = tolerances(torch.float32)
        if compare(run.records[rank][k].grad, ref.gradient, atol=atol, rtol=rtol).passed:  # type: ignore[arg-type]
            finding = "float32_computation"
            detail += ("; the error is at float32 rounding scale (within float32's tolerances): part of the loss or "
                       "gradient was computed in float32 (a .float() on the logits, an autocast region). If that is "
                       "intended, run the float32 lane alone (--precision fp32)")
    found = diagnose(run, k, rank)
    if found is not None:
        detail += "\n  " + found.line()
    return _failed("parity", run, detail, k, finding=finding, diagnosis=None if found is None else found.to_dict(),
                   **numbers)


def ranks_agree(run: Run) -> Verdict:
    """After each optimizer step the parameters are bitwise identical on every rank."""
    bad = _single_rank("ranks_agree", run, "one rank has no peer to agree with") or _broken("ranks_agree", run)
    if bad:
        return bad
    assert run.records is not None
    for k in range(len(run.records[0])):
        for rank in range(1, run.world_size):
            d = max_abs_difference([run.records[0][k].params_after], [run.records[rank][k].params_after])
            if d != 0.0:
                return _failed("ranks_agree", run, f"rank {rank}'s parameters differ from rank 0's by up to {d:.3e} "
                               "after the step", k, max_error=d)
    return _passed("ranks_agree", run, "parameters identical on every rank after every step", max_error=0.0)


def one_sync(run: Run) -> Verdict:
    """Exactly one gradient synchronization per window: the earlier microbatches ran inside ``no_sync()``."""
    bad = _single_rank("one_sync", run, "one rank has nothing to synchronize (skipping no_sync() is right here)")
    bad = bad or _broken("one_sync", run)
    if bad:
        return bad
    assert run.records is not None
    for rank, records in enumerate(run.records):
        for k, rec in enumerate(records):
            if rec.syncs != 1:
                n = len(run.windows[k][rank])
                return _failed("one_sync", run, f"rank {rank} synchronized gradients {rec.syncs} times in a window "
                               f"of {n} microbatches; expected 1 (forward and backward of all but the last microbatch "
                               "inside model.no_sync())", k)
    return _passed("one_sync", run, "one synchronization per window on every rank")


def logged_loss(run: Run) -> Verdict:
    """When the recipe returns a loss, it is the global token mean at the weights the recipe started the window
    from (its own, right or wrong), the same on every rank."""
    bad = _broken("logged_loss", run)
    if bad:
        return bad
    assert run.records is not None
    atol, rtol = tolerances(torch.float32 if run.precision == "fp32" else torch.float64)
    worst: float | None = None
    for k, ref in enumerate(run.references):
        if ref is None:
            continue
        values = [records[k].logged for records in run.records]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values):
            return _failed("logged_loss", run, f"some ranks returned a loss and others None: {values}", k)
        truth: dict[bytes, float] = {}
        for rank, v in enumerate(values):
            before = run.records[rank][k].params_before
            key = before.numpy().tobytes()
            if key not in truth:
                truth[key] = token_mean_at(run, before, k)
            want = truth[key]
            err = abs(v - want)  # type: ignore[operator]
            if not err <= atol + rtol * abs(want):
                return _failed("logged_loss", run, f"rank {rank} logged {v!r}; the global token mean at its weights "
                               f"is {want!r} (error {err:.3e})", k, max_error=err)
            worst = err if worst is None else max(worst, err)
    if worst is None:
        return _passed("logged_loss", run, "no logged loss returned (it is optional)")
    return _passed("logged_loss", run, "the logged loss is the global token mean on every rank", max_error=worst)


def hygiene(run: Run) -> Verdict:
    """The recipe leaves the model's mode and the global random generators (Python's ``random``, numpy, torch CPU and
    CUDA) alone, and keeps gradients in the model's dtype. Thread count and environment changes are notes: they
    cannot change a gradient."""
    bad = _broken("hygiene", run)
    if bad:
        return bad
    assert run.records is not None
    dtype = "torch.float32" if run.precision == "fp32" else "torch.float64"
    notes: list[str] = []
    for rank, records in enumerate(run.records):
        for k, rec in enumerate(records):
            if rec.mode_changed:
                return _failed("hygiene", run, f"rank {rank}: the recipe took the model out of train mode", k)
            if rec.rng_changed:
                return _failed("hygiene", run, f"rank {rank}: the recipe moved the global random generator(s) "
                               f"{', '.join(rec.rng_changed)}: use a generator of its own", k)
            if any(d != dtype for d in rec.grad_dtypes):
                return _failed("hygiene", run, f"rank {rank}: gradients in {sorted(set(rec.grad_dtypes))}, the model "
                               f"is {dtype}", k)
            notes += [f"rank {rank}, window {k}: {n}" for n in rec.notes]
    detail = "mode, random generators and dtype untouched" + (f" (notes: {'; '.join(notes)})" if notes else "")
    return _passed("hygiene", run, detail, notes=tuple(notes))


def empty_window(run: Run) -> Verdict:
    """A window without any supervised token: every rank raises ValueError, none hangs, and the recipe leaves no
    gradient other than zero and no weight changed (what a training loop would otherwise step on)."""
    bad = _failed_run("empty_window", run)
    if bad:
        return bad
    assert run.records is not None
    for rank, records in enumerate(run.records):
        rec = records[0]
        if rec.error is None or not rec.error.startswith("ValueError"):
            return _failed("empty_window", run, f"rank {rank} did not raise ValueError on a window without any "
                           "supervised token (a training loop would step its optimizer on nothing)", 0)
        if rec.grads_left not in ("none", "zero"):
            return _failed("empty_window", run, f"rank {rank} raised, but left {rec.grads_left} gradients in .grad "
                           "for the next window to add to", 0)
        if rec.weights_touched != 0.0:
            return _failed("empty_window", run, f"rank {rank} changed weights by up to {rec.weights_touched:.3e} "
                           "before raising", 0, max_error=rec.weights_touched)
    return _passed("empty_window", run, "every rank raised ValueError and left no gradient and no weight changed")


CHECKS: dict[str, Callable[[Run], Verdict]] = {
    "parity": parity,
    "ranks_agree": ranks_agree,
    "one_sync": one_sync,
    "logged_loss": logged_loss,
    "hygiene": hygiene,
    "empty_window": empty_window,
}
"""Every check by name (the battery plan, the command line and the controls' targets name them)."""
