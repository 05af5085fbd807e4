"""The empty window's two correct policies, judged on the ``all_empty`` scenario (no supervised token on any rank).

A global token mean over no token is 0/0: a training loop must not step on it. Two answers are right, if every rank
takes the same one (decided on the global count), none hangs and the recipe changes no weight:

- **raise**: every rank raises ``ValueError`` (the harness's ``require_tokens``), leaving no gradient but zeros;
- **zero gradients**: every rank returns, leaving zero gradients or none, no NaN or inf: a loop that skips the
  window (no forward, no backward, on every rank alike), or whose loss over no token is 0 (a sum divided by
  ``max(count, 1)``). transformers' Trainer, accelerate's and torchtitan's losses land here too: their loss is 0/0 =
  NaN, but cross-entropy gives ignored positions no gradient, so every gradient is zero. A NaN logged loss is then a
  note, not a failure: the optimizer still steps (momentum, weight decay) unless the loop skips the step.

A NaN or inf gradient (a masked loss sum divided by a zero count: ``0 * inf`` in its backward), nonzero gradients, a
raise on some ranks only, ranks that disagree on whether to run the backward, and a hang fail.
"""

from __future__ import annotations

import math

from harness.battery.judge.verdict import Verdict, failed, passed
from harness.battery.launch.run import Run, WindowRecord

EMPTY_LEFT = {
    "nonfinite": "NaN/inf in .grad",
    "nonzero": "nonzero gradients in .grad",
    "zero": "zero gradients in .grad",
    "none": "no gradient in .grad",
}
"""What a rank left in ``.grad`` after a window without any supervised token, in words."""

SKIP_THE_STEP = ("the optimizer still steps on a window without any supervised token: momentum and weight decay move "
                 "the weights (and the schedule advances) unless the loop skips optimizer.step() when the window's "
                 "global count is 0")
"""The consequence a window of zero gradients carries into a training loop, and what to do about it."""


def _returned(rec: WindowRecord) -> str:
    """The value a rank's ``backward_window`` returned on the empty window: its logged loss (nan from a 0/0 mean,
    0.0 from a zero sum) or None."""
    return "None" if rec.logged is None else str(float(f"{rec.logged:.6g}"))


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def judge(run: Run) -> Verdict:
    """The empty_window check's verdict on a run that finished (a hang, a desync or a crash is
    :func:`harness.battery.judge.failed_runs.failed_run`'s): the ranks' decisions, what each left in ``.grad`` and in
    the weights, and the synchronizations they ran."""
    assert run.records is not None, "a failed run is failed_runs' to read"
    recs = [records[0] for records in run.records]
    raised = [r for r, rec in enumerate(recs) if rec.error is not None and rec.error.startswith("ValueError")]
    returned = [r for r in range(len(recs)) if r not in raised]
    if raised and returned:
        rank = returned[0]
        return failed("empty_window", run, f"{_ranks(raised)} raised ValueError and {_ranks(returned)} returned "
                      f"{_returned(recs[rank])} on a window without any supervised token, leaving "
                      f"{EMPTY_LEFT.get(recs[rank].grads_left, recs[rank].grads_left)}: the ranks took different "
                      "decisions, so a training loop would go on with some ranks and not others", 0,
                      fix="decide on the global count (all-reduced over every rank), not on a rank's own state: "
                      "raise ValueError on every rank when it is 0, or skip the window on every rank")
    for rank, rec in enumerate(recs):
        if rec.weights_touched != 0.0:
            how = "before raising" if rank in raised else "on a window without any supervised token"
            return failed("empty_window", run, f"rank {rank} changed weights by up to {rec.weights_touched:.3e} "
                          f"{how}", 0, max_error=rec.weights_touched,
                          fix="leave the weights alone in backward_window: the optimizer step belongs to the loop")
        if rec.grads_left in ("nonfinite", "nonzero"):
            left = EMPTY_LEFT[rec.grads_left]
            if rank in raised:
                detail = f"rank {rank} raised ValueError, but left {left} for the next window to add to"
            else:
                detail = (f"rank {rank} returned {_returned(rec)} on a window without any supervised token, leaving "
                          f"{left}: a training loop would step its optimizer on "
                          f"{'it' if rec.grads_left == 'nonfinite' else 'gradients of no token'}")
            why = (" (a loss sum divided by a zero count: 0 * inf in the backward of a masked loss)"
                   if rec.grads_left == "nonfinite" else "")
            return failed("empty_window", run, detail + why, 0,
                          fix="check the global count before any forward and backward: raise ValueError on every "
                          "rank when it is 0 (harness.recipes.require_tokens), or skip the window, or divide by "
                          "max(count, 1) so that no token gives a zero loss and zero gradients")
    if raised:
        return passed("empty_window", run, "every rank raised ValueError and left no gradient and no weight changed")
    syncs = {rec.syncs for rec in recs}
    if len(syncs) > 1:
        ahead = [r for r, rec in enumerate(recs) if rec.syncs == max(syncs)]
        return failed("empty_window", run, f"{_ranks(ahead)} synchronized gradients {max(syncs)} time(s), other "
                      f"ranks {min(syncs)}: some ranks skipped the backward of the empty window while others ran it, "
                      "and their collectives no longer match", 0,
                      fix="skip the window's backward on every rank or on none, decided from the global count")
    kept = sorted({EMPTY_LEFT.get(rec.grads_left, rec.grads_left) for rec in recs})
    values = sorted({_returned(rec) for rec in recs})
    detail = (f"every rank returned {' / '.join(values)} and left {' / '.join(kept)} (the zero-gradient policy: no "
              "NaN or inf, no weight changed)")
    notes: tuple[str, ...] = ()
    nonfinite = [r for r, rec in enumerate(recs) if rec.logged is not None and not math.isfinite(rec.logged)]
    if nonfinite:
        beside = "zero gradients" if any(rec.grads_left == "zero" for rec in recs) else "no gradient"
        notes = (f"{_ranks(nonfinite)} logged {_returned(recs[nonfinite[0]])} beside {beside} (a mean over no token "
                 f"is 0/0): {SKIP_THE_STEP}",)
        detail += f"; note: {notes[0]}"
    elif any(rec.grads_left == "zero" for rec in recs):
        detail += ("; a loop must still skip its optimizer step on such a window (momentum and weight decay move the "
                   "weights on zero gradients)")
    return passed("empty_window", run, detail, notes=notes, finding="nan_logged_loss" if nonfinite else None)


__all__ = ["EMPTY_LEFT", "SKIP_THE_STEP", "judge"]
