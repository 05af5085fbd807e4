"""The battery's checks: each turns a :class:`~harness.battery.launch.run.Run` into a
:class:`~harness.battery.judge.verdict.Verdict` with the numbers behind it.

Each is one function registered with :func:`~harness.battery.judge.registry.check`, in the order the battery reports
them; importing this module fills :data:`harness.battery.judge.registry.REGISTRY`. A run that failed is read as a
verdict by :mod:`harness.battery.judge.failed_runs` before a check compares anything.
"""

from __future__ import annotations

import torch

from harness.battery.diagnose.of_run import diagnose, evidence_of, worst
from harness.battery.judge import empty_window as empty
from harness.battery.judge.failed_runs import failed_run, unexpected_error
from harness.battery.judge.registry import check
from harness.battery.judge.run_fixes import verdict_fix
from harness.battery.judge.verdict import NOT_APPLICABLE, Verdict, failed, make_verdict, passed, strategy
from harness.battery.launch.run import Run, token_mean_at
from harness.battery.rank.rank_program import SKIP_SYNC
from harness.battery.rank.rng_watch import hygiene_fix, moved_detail
from harness.core.compare import compare, max_abs_difference, tolerances
from harness.diagnosis.ranks import rounding_only

BF16_RELATIVE_L2 = 2e-2
"""A float32-lane error this small in relative L2 (``|g - ref| / |ref|``) sits at bfloat16 rounding scale: the correct
recipe under bf16 autocast misses the reference by 4.1e-3 to 4.6e-3, a mean of local means by 0.51 to 0.61, and 23 vs
25 tokens by at least 3.75e-2 (FACTS, measured on these machines)."""


def _broken(check: str, run: Run) -> Verdict | None:
    return failed_run(check, run) or unexpected_error(check, run)


def _single_rank(check: str, run: Run, why: str) -> Verdict | None:
    if run.world_size == 1:
        return make_verdict(check, run, NOT_APPLICABLE, why)
    return None


def _autocast(run: Run) -> str | None:
    for records in run.records or ():
        for rec in records:
            if rec.autocast:
                return rec.autocast
    return None


def _edited_before(run: Run, rank: int, window: int) -> str | None:
    """Where the recipe changed weights up to ``window`` on ``rank`` (its gradient is then taken elsewhere than the
    reference's chain), else None."""
    assert run.records is not None
    for j, rec in enumerate(run.records[rank][: window + 1]):
        if rec.weights_changed:
            names = ", ".join(rec.weights_changed[:4]) + (" ..." if len(rec.weights_changed) > 4 else "")
            when = "in this window" if j == window else f"in window {j}"
            return (f"the recipe itself changed weights {when} ({names}, by up to {rec.weights_touched:.3e}; see "
                    "weights_unchanged), so this gradient is not taken at the reference's weights")
    return None


def _scalar_tolerances(run: Run) -> tuple[float, float]:
    """``(atol, rtol)`` for a logged loss or a gradient norm: the lane's own, and in the bf16 lane the derived bound
    as a relative tolerance (a loss computed in bf16 carries its rounding like the gradient does)."""
    if run.precision == "bf16" and run.bf16 is not None:
        return 0.0, float(run.bf16.bound)
    return tolerances(torch.float32 if run.precision == "fp32" else torch.float64)


def _relative_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    norm = float(ref.double().norm())
    return float((got.double() - ref.double()).norm()) / norm if norm > 0 else float("inf")


@check(per_precision=True)
def parity(run: Run) -> Verdict:
    """Every rank's synchronized gradient equals the single-device reference, window by window."""
    bad = _broken("parity", run)
    if bad:
        return bad
    assert run.records is not None
    if run.precision == "bf16":
        return _parity_bf16(run)
    autocast = _autocast(run)
    if autocast is not None and run.precision == "fp64":
        return make_verdict("parity", run, NOT_APPLICABLE, f"the recipe's forward runs under autocast ({autocast}); "
                            "autocast leaves float64 alone on the CPU, so this lane would judge a float64 computation "
                            "the recipe never runs in training: the float32 lane judges it (--precision fp32)",
                            finding="autocast")
    picked = worst(run)
    assert picked is not None
    k, rank = picked
    ref = run.references[k]
    assert ref is not None
    lowered = run.computes_in == "torch.float32" and run.precision == "fp64"
    # The model's own float32 arithmetic rounds differently under the ranks' W/N and the reference's 1/N (exactly
    # alike only when W is a power of two): float64 tolerances would judge the world size, not the recipe.
    atol, rtol = tolerances(torch.float32) if lowered else tolerances(ref.gradient.dtype)
    c = compare(run.records[rank][k].grad, ref.gradient, atol=atol, rtol=rtol)  # type: ignore[arg-type]
    numbers = {"max_error": c.max_abs_error, "worst_ratio": c.worst_ratio, "over_tolerance": c.over_tolerance}
    detail = f"worst on rank {rank}: {c.summary()}"
    if lowered:
        detail += " (float32 tolerances: the model computes part of its forward in float32)"
    if c.passed:
        return passed("parity", run, detail, window=k, **numbers)
    finding = None
    if run.precision == "fp64" and not lowered:
        atol, rtol = tolerances(torch.float32)
        if compare(run.records[rank][k].grad, ref.gradient, atol=atol, rtol=rtol).passed:  # type: ignore[arg-type]
            finding = "float32_computation"
            detail += ("; the error is at float32 rounding scale (within float32's tolerances): part of the loss or "
                       "gradient was computed in float32 (a .float() on the logits, an autocast region). If that is "
                       "intended, run the float32 lane alone (--precision fp32)")
    edited = _edited_before(run, rank, k)
    if edited:
        detail += f"; {edited}"
    for note in run.records[rank][k].strategy_notes:
        detail += f"; {note}"
    found = diagnose(run, k, rank)
    rel = _relative_l2(run.records[rank][k].grad, ref.gradient)  # type: ignore[arg-type]
    # bf16 rounding is named where it is the likely cause: autocast was seen, or the fitted weights are right and
    # only a rounding-sized residue is left (a count one token off, or tokens off by a few percent, also miss by a
    # small relative error: the weights show those, and the diagnosis names them).
    if (finding is None and run.precision == "fp32" and rel <= BF16_RELATIVE_L2
            and (autocast or (found is not None and rounding_only(found.ratios(), found.residual)))):
        finding = "bf16_computation"
        how = (f"the forward ran under autocast ({autocast})" if autocast else
               "part of the computation ran in bfloat16 or float16 (an autocast region, a .to(torch.bfloat16))")
        detail += (f"; the error is at bfloat16 rounding scale (relative L2 {rel:.2e}, under {BF16_RELATIVE_L2:g}): "
                   f"{how}. The float32 lane's tolerances judge float32 arithmetic; a weighting mistake is far "
                   "larger (a mean of local means misses by a relative L2 of about 0.5)")
    if found is not None:
        detail += "\n  " + found.line()
    return failed("parity", run, detail, k, finding=finding, diagnosis=None if found is None else found.to_dict(),
                  fix=verdict_fix("parity", run, finding) if finding or found is None else found.fix, **numbers)


def _parity_bf16(run: Run) -> Verdict:
    """Parity in the bf16 lane: each judged window's error (relative L2 against the float64 gradient at the rank's
    own starting weights) within the bound derived from the correct computation's measured noise
    (:mod:`harness.battery.prepare.bf16`); windows too balanced for a mean of local means to stand above the bound are
    refused, and said so."""
    from harness.battery.prepare import bf16

    noise = run.bf16
    assert noise is not None, "a bf16 run carries its measured noise (harness.battery.prepare.steps)"
    read = bf16.read_windows(run, bf16.gradient_function(run.spec, run.objective))
    judged = [w for w in read if w.mistake >= bf16.SEPARATION * noise.bound]
    refused = [w for w in read if w not in judged]
    said = noise.describe()
    if refused:
        said += "; window(s) " + ", ".join(
            f"{w.window} (a mean of local means would miss by {w.mistake:.2e} only)" for w in refused) + (
            f" not judged: too balanced for a weighting mistake to stand {bf16.SEPARATION:g}x above the bound")
    scaled = bf16.scale_finding(noise, read)  # a uniform scale: judged on every window, balanced or not
    if not judged and scaled is None:
        return make_verdict("parity", run, NOT_APPLICABLE, f"no window of this case can be judged in bf16: {said}")
    w = max(judged or read, key=lambda w: w.error)
    detail = (f"worst on rank {w.rank}, window {w.window}: error {w.error:.2e}, {w.error / noise.bound:.2f}x the "
              f"bound; {said}; a mean of local means would miss by {w.mistake:.2e} here "
              f"({w.mistake / noise.bound:.0f}x the bound)")
    numbers = {"max_error": w.error, "worst_ratio": w.error / noise.bound}
    within = noise.bound
    if scaled is not None and not (judged and w.error > noise.bound):
        w, detail = scaled  # the relative L2 passed: the scale alone fails, read to the scale's own accuracy
        numbers = {"max_error": abs(w.scale - 1), "worst_ratio": abs(w.scale - 1) / noise.scale_bound}
        within = noise.scale_bound
    elif w.error <= noise.bound:
        return passed("parity", run, f"{detail}; {noise.scale_note()}", window=w.window, **numbers)
    k, rank = w.window, w.rank
    from harness.diagnosis.fit import accuracy

    with accuracy(within):  # the weights are read to the accuracy bf16 allows, no finer
        found = diagnose(run, k, rank)
    if found is not None:
        detail += "\n  " + found.line() + f" (read from a bf16 gradient: weights to within {within:.1e})"
    return failed("parity", run, detail, k, diagnosis=None if found is None else found.to_dict(),
                  fix=verdict_fix("parity", run) if found is None else found.fix, **numbers)


@check()
def one_sync(run: Run) -> Verdict:
    """Exactly one gradient synchronization per window: the earlier microbatches ran inside ``no_sync()``. On a
    pipeline, one per schedule step the rank recorded (at least one): torch's schedules reduce a data-parallel stage
    at the end of every step, inside ``no_sync()`` or not (:mod:`harness.recipes.pipelined`), so a window of A steps
    synchronizes A times, and a step that synchronized twice (its shape inference's backward reduced) is one more."""
    bad = _single_rank("one_sync", run, "one rank has nothing to synchronize (skipping no_sync() is right here)")
    if bad is None and run.mesh.size("pp") > 1 and run.mesh.token_ranks == 1:
        bad = make_verdict("one_sync", run, NOT_APPLICABLE, f"mesh {run.mesh.label}: each pipeline stage has no "
                           "data-parallel peer, so there is no gradient synchronization to count")
    bad = bad or _broken("one_sync", run)
    if bad:
        return bad
    assert run.records is not None
    pipelined = run.mesh.size("pp") > 1
    most = 1
    for rank, records in enumerate(run.records):
        for k, rec in enumerate(records):
            expected = max(1, len(rec.pipeline_steps)) if pipelined else 1
            most = max(most, expected)
            if rec.syncs != expected:
                n = len(run.windows[k][run.mesh.data_rank(rank)])
                why = (f"one per schedule step: {expected} step{'s' if expected > 1 else ''} recorded" if pipelined
                       else f"forward and backward of all but the last microbatch inside "
                       f"{SKIP_SYNC.get(strategy(run), 'model.no_sync()')}")
                return failed("one_sync", run, f"rank {rank} synchronized gradients {rec.syncs} times in a window "
                              f"of {n} microbatches; expected {expected} ({why})", k, fix=verdict_fix("one_sync", run))
    if pipelined and most > 1:
        return passed("one_sync", run, f"one synchronization per schedule step on every rank (up to {most} per "
                      "window: torch's schedules reduce a data-parallel stage at the end of every step)")
    return passed("one_sync", run, "one synchronization per window on every rank")


@check()
def ranks_agree(run: Run) -> Verdict:
    """After each optimizer step the parameters are bitwise identical on every rank."""
    bad = _single_rank("ranks_agree", run, "one rank has no peer to agree with") or _broken("ranks_agree", run)
    if bad:
        return bad
    assert run.records is not None
    for k in range(len(run.records[0])):
        params = [records[k].params_after for records in run.records]
        for rank in range(1, run.world_size):
            d = max_abs_difference([params[0]], [params[rank]])
            if d != 0.0:
                where = _differing_dimension(run, params)
                say = (f"rank {rank}'s parameters differ from rank 0's by up to {d:.3e} after the step" if where is None
                       else where)
                return failed("ranks_agree", run, say, k, max_error=d, fix=verdict_fix("ranks_agree", run))
    return passed("ranks_agree", run, "parameters identical on every rank after every step", max_error=0.0)


def _differing_dimension(run: Run, params: list[torch.Tensor]) -> str | None:
    """On a mesh of more than one dimension: the first pair of ranks whose full parameters differ and whose
    coordinates differ along one dimension only, named by it ("ranks 0 and 1 differ along tp (the ranks of one dp
    coordinate) by ..."); None on a one-dimensional run (every pair differs along dp). Some such pair exists
    whenever two ranks differ: the pairs along one dimension connect every rank."""
    mesh = run.mesh
    if len([n for n in mesh.names if mesh.size(n) > 1]) < 2:
        return None
    for dim in mesh.names:
        for group in mesh.groups([dim]):
            for b in group[1:]:
                d = max_abs_difference([params[group[0]]], [params[b]])
                if d != 0.0:
                    others = " x ".join(n for n in mesh.names if n != dim and mesh.size(n) > 1)
                    return (f"ranks {group[0]} and {b} differ along {dim} (the ranks of one {others} coordinate) by "
                            f"up to {d:.3e} after the step (the full parameters, gathered, must agree on every rank)")
    return None


def _loss_dtype(run: Run) -> tuple[torch.dtype, str | None]:
    """The dtype a logged loss is judged at: the lane's, but float32 in the float64 lane where the loss is known to be
    computed in float32 (the model probe found float32 in the forward: its note says the lane judges the model at
    float32's tolerances; or a rank returned its loss as a float32 tensor), with the reason (None: the lane's own)."""
    if run.precision != "fp64":
        return (torch.float32 if run.precision == "fp32" else torch.float64), None
    if run.computes_in == "torch.float32":
        return torch.float32, "the model computes part of its forward in float32 (the model's note)"
    for records in run.records or ():
        for rec in records:
            if rec.logged_dtype == "torch.float32":
                return torch.float32, "the recipe returned its loss as a torch.float32 tensor"
    return torch.float64, None


def _logged_tolerances(run: Run) -> tuple[float, float, str | None]:
    """``(atol, rtol, why)`` for a logged loss: the bf16 lane's derived bound, else the tolerances of the dtype the
    loss was computed in (:func:`_loss_dtype`)."""
    if run.precision == "bf16":
        return (*_scalar_tolerances(run), None)
    dtype, why = _loss_dtype(run)
    return (*tolerances(dtype), why)


@check()
def logged_loss(run: Run) -> Verdict:
    """When the recipe returns a loss, it is the global token mean at the weights the recipe started the window
    from (its own, right or wrong), the same on every rank; judged at the tolerances of the dtype the loss was
    computed in (float32's in the float64 lane for a model or a returned tensor in float32)."""
    bad = _broken("logged_loss", run)
    if bad:
        return bad
    assert run.records is not None
    atol, rtol, lowered = _logged_tolerances(run)
    judged = f" (float32 tolerances: {lowered})" if lowered else ""
    worst: float | None = None
    for k, ref in enumerate(run.references):
        if ref is None:
            continue
        values = [records[k].logged for records in run.records]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values):
            return failed("logged_loss", run, f"some ranks returned a loss and others None: {values}", k,
                          fix=verdict_fix("logged_loss", run))
        truth: dict[bytes, float] = {}
        for rank, v in enumerate(values):
            before = run.records[rank][k].params_before
            key = before.numpy().tobytes()
            if key not in truth:
                truth[key] = token_mean_at(run, before, k)
            want = truth[key]
            err = abs(v - want)  # type: ignore[operator]
            if not err <= atol + rtol * abs(want):
                what = "the global token mean" if run.objective.plain else f"the {run.objective.name} objective"
                detail = f"rank {rank} logged {v!r}; {what} at its weights is {want!r} (error {err:.3e}){judged}"
                finding = None
                f32_atol, f32_rtol = tolerances(torch.float32)
                if run.precision == "fp64" and not lowered and err <= f32_atol + f32_rtol * abs(want):
                    finding = "float32_computation"
                    detail += ("; the error is at float32 rounding scale (within float32's tolerances): the loss was "
                               "computed in float32 (a .float() on the logits, as transformers' loss does) and "
                               "returned as a Python float or a float64 tensor, which hide the dtype it was computed "
                               "in. Return the loss as the tensor it was computed in (loss.detach()) to have it "
                               "judged at float32's tolerances in this lane, or run the float32 lane alone "
                               "(--precision fp32)")
                return failed("logged_loss", run, detail, k, max_error=err, finding=finding,
                              fix=verdict_fix("logged_loss", run, finding))
            worst = err if worst is None else max(worst, err)
    if worst is None:
        return passed("logged_loss", run, "no logged loss returned (it is optional)")
    return passed("logged_loss", run, f"the logged loss is the global token mean on every rank{judged}",
                  max_error=worst)


@check(per_precision=True)
def hygiene(run: Run) -> Verdict:
    """The recipe leaves the model's mode and the global random generators (Python's ``random``, numpy, torch CPU and
    CUDA) alone, and keeps gradients in the model's dtype. Thread count and environment changes are notes: they
    cannot change a gradient."""
    bad = _broken("hygiene", run)
    if bad:
        return bad
    assert run.records is not None
    dtype = "torch.float64" if run.precision == "fp64" else "torch.float32"  # bf16: float32 master weights
    notes: list[str] = []
    for rank, records in enumerate(run.records):  # setup() runs before any window: its moves are reported first
        if records and records[0].setup_rng_changed:
            said = moved_detail(records[0].setup_rng_changed, records[0].setup_rng_moves, "setup")
            return failed("hygiene", run, f"rank {rank}: {said}",
                          fix=hygiene_fix(records[0].setup_rng_moves, True) or verdict_fix("hygiene", run))
    for rank, records in enumerate(run.records):
        for k, rec in enumerate(records):
            if rec.mode_changed:
                return failed("hygiene", run, f"rank {rank}: the recipe took the model out of train mode", k,
                              fix=verdict_fix("hygiene", run))
            if rec.rng_changed:
                return failed("hygiene", run, f"rank {rank}: {moved_detail(rec.rng_changed, rec.rng_moves)}", k,
                              fix=hygiene_fix(rec.rng_moves) or verdict_fix("hygiene", run))
            if any(d != dtype for d in rec.grad_dtypes):
                return failed("hygiene", run, f"rank {rank}: gradients in {sorted(set(rec.grad_dtypes))}, the model "
                              f"is {dtype}", k, fix=verdict_fix("hygiene", run))
            notes += [f"rank {rank}, window {k}: {n}" for n in rec.notes]
    detail = "mode, random generators and dtype untouched" + (f" (notes: {'; '.join(notes)})" if notes else "")
    return passed("hygiene", run, detail, notes=tuple(notes))


@check()
def clipping(run: Run) -> Verdict:
    """A recipe that clips (its ``backward_window`` takes ``max_norm``) returns, on every rank, the reference's global
    gradient norm before clipping: over every parameter and every rank's tokens, not one rank's share, not one
    shard's. (The clipped gradient itself is parity's: the reference is clipped the same way; that the ranks stay
    identical is ranks_agree's.)"""
    if run.max_norm is None:
        return make_verdict("clipping", run, NOT_APPLICABLE, "the recipe does not clip (a recipe whose backward_window "
                            "takes a max_norm keyword clips and returns (loss, norm); docs/recipe-contract.md)")
    bad = _broken("clipping", run)
    if bad:
        return bad
    assert run.records is not None
    atol, rtol = _scalar_tolerances(run)
    worst_error, engaged = 0.0, 0
    for k, want in enumerate(run.reference_norms):
        if want is None:
            continue
        engaged += want > run.max_norm
        for rank, records in enumerate(run.records):
            if k >= len(records) or records[k].error is not None:
                continue
            got = records[k].grad_norm
            if got is None:
                return failed("clipping", run, f"rank {rank} returned no norm: a clipping recipe returns (loss, "
                              "total_norm), the norm clip_grad_norm_ returns", k,
                              fix=verdict_fix("clipping", run, "clipping_no_norm"))
            err = abs(got - want)
            if not err <= atol + rtol * abs(want):
                from harness.diagnosis.clipping import read_norm

                norm = read_norm(evidence_of(run), k, rank, got)  # which norm it is, named only where the number fits
                return failed("clipping", run, f"rank {rank} returned the gradient norm {got:.6g}, {norm.ratio:.4g}x "
                              f"the reference's global norm before clipping, {want:.6g} (error {err:.3e}; max_norm "
                              f"{run.max_norm:.6g}): {norm.sentence}", k, max_error=err, finding=norm.name,
                              fix=verdict_fix("clipping", run, norm.name))
            worst_error = max(worst_error, err)
    return passed("clipping", run, f"every rank returned the reference's global norm (max_norm {run.max_norm:.6g}, "
                  f"clipping engaged in {engaged} window(s))", max_error=worst_error)


@check(scenarios="all_empty")
def empty_window(run: Run) -> Verdict:
    """A window without any supervised token has two correct answers, taken alike on every rank, none hanging, no
    weight changed by the recipe: every rank raises ValueError leaving no gradient but zeros, or every rank returns
    leaving zero gradients or none (a loop that skips the window, or whose loss over no token is 0). A NaN or inf
    gradient, nonzero gradients, a raise on some ranks only, or a hang fail; a NaN logged loss beside zero gradients
    is a note (the optimizer would still step). The judging is :func:`harness.battery.judge.empty_window.judge`."""
    return failed_run("empty_window", run) or empty.judge(run)


@check(scenarios="every")
def weights_unchanged(run: Run) -> Verdict:
    """``backward_window`` leaves every weight bitwise as it found it: stepping, weight decay and any other edit of
    the weights belong to the training loop, after the gradient the battery checks."""
    bad = failed_run("weights_unchanged", run)
    if bad:
        return bad
    assert run.records is not None
    for rank, records in enumerate(run.records):
        for k, rec in enumerate(records):
            if rec.weights_changed:
                names = ", ".join(rec.weights_changed[:6]) + (
                    f" and {len(rec.weights_changed) - 6} more" if len(rec.weights_changed) > 6 else "")
                return failed("weights_unchanged", run, f"rank {rank}: backward_window changed "
                              f"{len(rec.weights_changed)} weight tensor(s) in place ({names}) by up to "
                              f"{rec.weights_touched:.3e}; a recipe must leave the weights alone (an in-place weight "
                              "decay, an optimizer step or a weight clamp belongs to the training loop, after "
                              "backward_window returns)", k, max_error=rec.weights_touched,
                              fix=verdict_fix("weights_unchanged", run))
    return passed("weights_unchanged", run, "every call left every weight bitwise unchanged on every rank",
                  max_error=0.0)

