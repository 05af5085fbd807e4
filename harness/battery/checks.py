"""The battery's checks: each turns a :class:`~harness.battery.runner.Run` into a verdict with the numbers behind it.

A verdict never raises; the battery's tests assert ``verdict.passed`` with ``verdict.message``, the negative-control
tests assert the opposite, and the command line prints them as a table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from harness.battery.runner import Run
from harness.compare import compare, max_abs_difference, tolerances

CHECKS = ("parity", "ranks_agree", "one_sync", "logged_loss", "hygiene", "empty_window")


@dataclass(frozen=True)
class Verdict:
    check: str
    recipe: str
    scenario: str
    world_size: int
    precision: str
    passed: bool
    message: str
    max_error: float | None = None
    worst_ratio: float | None = None
    over_tolerance: int | None = None
    window: int | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _verdict(check: str, run: Run, passed: bool, detail: str, window: int | None = None, **numbers: object) -> Verdict:
    head = "passed" if passed else "FAILED"
    message = f"check {check} {head}: {run.label(window)}: {detail}"
    return Verdict(check, run.recipe, run.scenario, run.world_size, run.precision, passed, message, window=window,
                   **numbers)  # type: ignore[arg-type]


def _failed_run(check: str, run: Run) -> Verdict | None:
    if run.failure is None:
        return None
    err = run.failure
    what = {"deadline": "hung past the deadline", "died": "lost a rank", "raised": "crashed"}.get(err.kind, err.kind)
    lines = [str(err).splitlines()[0]]
    for i, rank in enumerate(err.ranks):
        detail = [ln for ln in err.details.get(rank, "").splitlines() if ln.strip()]
        # A failing rank's traceback ends with the exception; a peer's faulthandler stack starts with its newest frame.
        lines += [f"  rank {rank}: {ln.strip()}" for ln in (detail[-2:] if i == 0 else detail[1:4])]
    return _verdict(check, run, False, f"the run {what}: " + "\n".join(lines))


def _unexpected_error(check: str, run: Run) -> Verdict | None:
    assert run.records is not None
    for rank, records in enumerate(run.records):
        for k, rec in enumerate(records):
            if rec.error is not None:
                return _verdict(check, run, False, f"rank {rank} raised {rec.error} on a window with tokens", k)
    return None


def parity(run: Run) -> Verdict:
    """Every rank's synchronized gradient equals the single-device reference, window by window."""
    bad = _failed_run("parity", run) or _unexpected_error("parity", run)
    if bad:
        return bad
    assert run.records is not None
    worst = None
    for k, ref in enumerate(run.references):
        assert ref is not None
        for rank in range(run.world_size):
            c = compare(run.records[rank][k].grad, ref.gradient)  # type: ignore[arg-type]
            if worst is None or c.worst_ratio > worst[0].worst_ratio:
                worst = (c, k, rank)
    assert worst is not None
    c, k, rank = worst
    detail = f"worst on rank {rank}: {c.summary()}"
    return _verdict("parity", run, c.passed, detail, k, max_error=c.max_abs_error, worst_ratio=c.worst_ratio,
                    over_tolerance=c.over_tolerance)


def ranks_agree(run: Run) -> Verdict:
    """After each optimizer step the parameters are bitwise identical on every rank."""
    bad = _failed_run("ranks_agree", run) or _unexpected_error("ranks_agree", run)
    if bad:
        return bad
    assert run.records is not None
    for k in range(len(run.records[0])):
        for rank in range(1, run.world_size):
            d = max_abs_difference([run.records[0][k].params_after], [run.records[rank][k].params_after])
            if d != 0.0:
                return _verdict("ranks_agree", run, False, f"rank {rank}'s parameters differ from rank 0's by up to "
                                f"{d:.3e} after the step", k, max_error=d)
    return _verdict("ranks_agree", run, True, "parameters identical on every rank after every step", max_error=0.0)


def one_sync(run: Run) -> Verdict:
    """Exactly one gradient synchronization per window: the earlier microbatches ran inside ``no_sync()``."""
    bad = _failed_run("one_sync", run) or _unexpected_error("one_sync", run)
    if bad:
        return bad
    assert run.records is not None
    for rank, records in enumerate(run.records):
        for k, rec in enumerate(records):
            if rec.syncs != 1:
                n = len(run.windows[k][rank])
                return _verdict("one_sync", run, False, f"rank {rank} synchronized gradients {rec.syncs} times in a "
                                f"window of {n} microbatches; expected 1 (forward and backward of all but the last "
                                "microbatch inside model.no_sync())", k)
    return _verdict("one_sync", run, True, "one synchronization per window on every rank")


def logged_loss(run: Run) -> Verdict:
    """When the recipe returns a loss, it is the global token mean, the same on every rank."""
    bad = _failed_run("logged_loss", run) or _unexpected_error("logged_loss", run)
    if bad:
        return bad
    assert run.records is not None
    atol, rtol = tolerances(torch.float32 if run.precision == "fp32" else torch.float64)
    worst: float | None = None
    for k, ref in enumerate(run.references):
        assert ref is not None
        values = [records[k].logged for records in run.records]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values):
            return _verdict("logged_loss", run, False, f"some ranks returned a loss and others None: {values}", k)
        for rank, v in enumerate(values):
            err = abs(v - ref.loss)  # type: ignore[operator]
            worst = err if worst is None else max(worst, err)
            if not err <= atol + rtol * abs(ref.loss):
                return _verdict("logged_loss", run, False, f"rank {rank} logged {v!r}, the global token mean is "
                                f"{ref.loss!r} (error {err:.3e})", k, max_error=err)
    if worst is None:
        return _verdict("logged_loss", run, True, "no logged loss returned (it is optional)")
    return _verdict("logged_loss", run, True, "the logged loss is the global token mean on every rank",
                    max_error=worst)


def hygiene(run: Run) -> Verdict:
    """The recipe leaves the model's mode and the global RNG state alone, and keeps gradients in the model's dtype."""
    bad = _failed_run("hygiene", run) or _unexpected_error("hygiene", run)
    if bad:
        return bad
    assert run.records is not None
    dtype = "torch.float32" if run.precision == "fp32" else "torch.float64"
    for rank, records in enumerate(run.records):
        for k, rec in enumerate(records):
            if rec.mode_changed:
                return _verdict("hygiene", run, False, f"rank {rank}: the recipe took the model out of train mode", k)
            if rec.rng_changed:
                return _verdict("hygiene", run, False, f"rank {rank}: the recipe changed the global torch RNG state", k)
            if any(d != dtype for d in rec.grad_dtypes):
                return _verdict("hygiene", run, False, f"rank {rank}: gradients in {set(rec.grad_dtypes)}, model is "
                                f"{dtype}", k)
    return _verdict("hygiene", run, True, "mode, RNG state and dtype untouched")


def empty_window(run: Run) -> Verdict:
    """A window with no supervised token anywhere: every rank raises ValueError, none hangs, no weight changes."""
    bad = _failed_run("empty_window", run)
    if bad:
        return bad
    assert run.records is not None
    for rank, records in enumerate(run.records):
        rec = records[0]
        if rec.error is None or not rec.error.startswith("ValueError"):
            return _verdict("empty_window", run, False, f"rank {rank} did not raise ValueError on a window without "
                            "any supervised token", 0)
        d = max_abs_difference([rec.params_before], [rec.params_after])
        if d != 0.0:
            return _verdict("empty_window", run, False, f"rank {rank}'s weights changed by {d:.3e}", 0, max_error=d)
    return _verdict("empty_window", run, True, "every rank raised ValueError; weights unchanged")
