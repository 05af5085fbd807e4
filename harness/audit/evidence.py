"""An audit's record as the diagnosis's evidence, and its verdict.

Each recorded call becomes a :class:`~harness.audit.calls.CallBatch` (:mod:`harness.audit.calls`: its labels
aligned to the positions that predict them, the call itself carried for the replay).

The reference replays each call of the window, with its own arguments, through a copy of the script's model at the
weights the window started from, in float64 on the CPU, dropout off, and takes the gradient of the declared objective
(``token_mean`` by default) over every rank's calls together, from the logits the model returns; where the loop
clipped (``clip_grad_norm_``), the reference is clipped the same way and the norm each rank's clip returned is judged
against the reference's. Parity compares the gradient the optimizer was about to use with it, at float32's tolerances,
and a failing window is read by :func:`harness.diagnosis.diagnose.diagnose`, the same reading and fix the battery
gives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from harness.audit.calls import ScriptModel, microbatch, model_from, read_labels
from harness.audit.options import check_labels, objective_parts
from harness.audit.record import Record
from harness.battery.prepare.bf16 import NOISE_MULTIPLE, SEPARATION, relative_l2
from harness.core import objectives as ob
from harness.core.compare import compare, tolerances
from harness.core.mesh import Mesh
from harness.core.microbatch import Microbatch
from harness.core.reference import Reference, reference_gradient
from harness.diagnosis.clipping import read_norm
from harness.diagnosis.diagnose import diagnose
from harness.diagnosis.evidence import Evidence, RankWindow, first_supervised, model_at, terms
from harness.diagnosis.fixes import check_fix
from harness.diagnosis.result import Diagnosis


@dataclass(frozen=True)
class AuditVerdict:
    """Parity of each audited window against the single-device reference, with the worst window's reading."""

    passed: bool
    lines: tuple[str, ...]
    diagnosis: Diagnosis | None = None
    problems: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return "\n".join(self.lines)


def objective_of(name: str) -> ob.Objective:
    """``token_mean``, ``sequence_mean`` or ``fixed_normalizer=C`` as an Objective. ValueError naming the choices."""
    base, constant = objective_parts(name)
    return ob.Objective(base, normalizer=constant)


def _clip_of(ranks: Sequence[Record], k: int) -> tuple[float | None, list[float | None]]:
    """The window's ``max_norm`` (None: no rank clipped) and each rank's returned norm (None: it did not clip)."""
    clips = [r.windows[k].clips[-1] if r.windows[k].clips else None for r in ranks]
    bounds = {c.max_norm for c in clips if c is not None}
    if len(bounds) > 1:
        msg = f"window {k}: the ranks clipped to different max_norm values {sorted(bounds)}"
        raise ValueError(msg)
    for c in clips:
        if c is not None and c.norm_type != 2.0:
            msg = f"window {k}: clip_grad_norm_ with norm_type={c.norm_type:g}; the audit judges the L2 clip only"
            raise ValueError(msg)
    return (next(iter(bounds)) if bounds else None), [None if c is None else c.returned for c in clips]


def evidence(audit: Record, others: Sequence[Record] = (), *, objective: str = "token_mean", labels: str = "auto",
             template: nn.Module | None = None) -> Evidence:
    """The audit's windows as :class:`~harness.diagnosis.evidence.Evidence`: ``audit`` is rank 0's record (it holds
    the model; ``template``, the model before it was sharded, where there is one), ``others`` the other ranks' in rank
    order (none: one process); each window's reference is computed here over every rank's calls. ValueError where a
    window cannot be read."""
    ranks = [audit, *others]
    if audit.model is None or not audit.windows:
        msg = (f"no optimizer step was recorded: the loop stepped {audit.steps} time(s), and the audit waits for "
               f"{audit.skip} step(s) to pass and then {audit.wanted} more, each after a call of the model with "
               "gradients on")
        raise ValueError(msg)
    if len({len(r.windows) for r in ranks}) != 1:
        msg = f"the ranks recorded {[len(r.windows) for r in ranks]} windows: they did not step together"
        raise ValueError(msg)
    declared = objective_of(objective)
    convention = ScriptModel(template if template is not None else audit.model, tuple(audit.windows[0].buffers))
    windows: list[list[list[Microbatch]]] = []
    references: list[Reference | None] = []
    norms: list[float | None] = []
    max_norm = None
    for k, w in enumerate(audit.windows):
        per_rank: list[list[Microbatch]] = [[microbatch(c, labels) for c in r.windows[k].calls] for r in ranks]
        windows.append(per_rank)
        bound, _ = _clip_of(ranks, k)
        max_norm = bound if bound is not None else max_norm
        ref = _reference(convention, w.start, per_rank, declared)
        norm = None if ref is None else float(ref.gradient.double().norm())
        if ref is not None and norm is not None and bound is not None:
            factor = min(1.0, bound / (norm + 1e-6))  # clip_grad_norm_'s own formula
            ref = Reference(gradient=ref.gradient * factor, loss=ref.loss, tokens=ref.tokens,
                            normalizer=ref.normalizer)
        references.append(ref)
        norms.append(norm)
    records = [[RankWindow(grad=w.grad, params_before=w.start, syncs=1 if w.syncs is None else w.syncs,
                           grad_norm=_clip_of(ranks, k)[1][r])
                for k, w in enumerate(rec.windows)] for r, rec in enumerate(ranks)]
    return Evidence(windows=windows, records=records, model=convention, mesh=Mesh.data_parallel(len(ranks)),
                    references=references, reference_starts=[w.start for w in audit.windows], reference_norms=norms,
                    max_norm=max_norm, objective=declared,
                    precision="bf16" if any(w.autocast for w in audit.windows) else "fp32",
                    recipe=f"the script's {type(audit.model).__name__}", scenario="its own data",
                    strategy="fsdp2" if audit.strategy == "fsdp2" else "ddp")


def _reference(convention: ScriptModel, start: torch.Tensor, per_rank: Sequence[Sequence[Microbatch]],
               objective: ob.Objective, dtype: torch.dtype = torch.float64) -> Reference | None:
    """The declared objective's gradient over every rank's calls at the flat weights ``start``, in ``dtype``."""
    if sum(mb.supervised for mbs in per_rank for mb in mbs) == 0:
        return None
    model = model_at(convention, start, dtype, first_supervised(per_rank))
    ref = reference_gradient(model, per_rank, convention.loss_sum, objective=None if objective.plain else objective,
                             terms_of=None if objective.plain else
                             (lambda m, mb: terms(convention, objective, None, m, mb)))
    return Reference(gradient=ref.gradient.to(start.dtype), loss=ref.loss, tokens=ref.tokens,
                     normalizer=ref.normalizer)


@dataclass(frozen=True)
class LowPrecision:
    """How a window computed under autocast is judged (the battery's bf16 lane, :mod:`harness.battery.prepare.bf16`):
    the correct computation replayed under the same autocast on one device misses the float64 reference by
    ``noise`` (relative L2); the window's gradient may miss it by ``bound``, ``NOISE_MULTIPLE`` times that.
    ``apart``: how far the mean of local means (one process: of per-microbatch means) stands from the reference, in
    bounds; under ``SEPARATION`` such a mistake could pass."""

    dtype: str
    noise: float
    bound: float
    apart: float


def low_precision(ev: Evidence, audit: Record) -> list[LowPrecision | None]:
    """Per window, its :class:`LowPrecision` where its calls ran under autocast (None elsewhere or without tokens)."""
    out: list[LowPrecision | None] = []
    convention = ev.model
    assert isinstance(convention, ScriptModel)
    for k, w in enumerate(audit.windows):
        ref = ev.references[k]
        if w.autocast is None or ref is None:
            out.append(None)
            continue
        truth = ref.gradient.double() / _clip_factor(ev, k)
        per_rank = ev.windows[k]
        dtype = getattr(torch, w.autocast)
        with torch.autocast("cpu", dtype=dtype):
            low = _reference(convention, w.start, per_rank, ev.objective, torch.float32)
        assert low is not None
        noise = relative_l2(low.gradient, truth)
        groups = per_rank if len(per_rank) > 1 else [[mb] for mb in per_rank[0]]
        means = [_reference(convention, w.start, [g], ev.objective) for g in groups]
        local = torch.stack([m.gradient.double() for m in means if m is not None]).mean(0)
        bound = NOISE_MULTIPLE * noise
        out.append(LowPrecision(w.autocast, noise, bound, relative_l2(local, truth) / bound if bound > 0 else math.inf))
    return out


def _clip_factor(ev: Evidence, k: int) -> float:
    norm = ev.reference_norms[k] if k < len(ev.reference_norms) else None
    return 1.0 if ev.max_norm is None or norm is None else min(1.0, ev.max_norm / (norm + 1e-6))


def judge(audit: Record, others: Sequence[Record] = (), *, objective: str = "token_mean", labels: str = "auto",
          template: nn.Module | None = None, model: str | None = None) -> AuditVerdict:
    """Each audited window's gradient on every rank against its reference, and each clip's norm; the worst failing
    window read by the diagnosis. The reference's model is a copy of ``template`` (default: the script's model as
    the watch found it, or as it was before ``fully_shard``), or of what ``model``, ``PKG.MODULE:FACTORY``, builds."""
    objective_of(objective)  # bad arguments raise (ValueError naming the choices); a record that cannot be read is
    check_labels(labels)     # a verdict that says so
    ranks = (audit, *others)
    problems = tuple(dict.fromkeys(p for r in ranks for p in r.problems))
    notes = list(dict.fromkeys(n for r in ranks for n in r.notes))
    refusal = next((r.refusal for r in ranks if r.refusal), None)
    template = template if template is not None else getattr(audit, "template", None)
    try:
        if refusal is not None:
            raise ValueError(refusal)
        if isinstance(model, str):
            template = model_from(model)
        ev = evidence(audit, others, objective=objective, labels=labels, template=template)
    except (ValueError, TypeError, RuntimeError) as exc:
        return AuditVerdict(False, (f"audit: not judged: {exc}", *(f"  note: {n}" for n in notes)),
                            problems=(*problems, str(exc)))
    atol, rtol = tolerances(torch.float32)
    wrapped = {"ddp": "DDP", "fsdp2": "FSDP2"}.get(audit.strategy or "", "no DDP or FSDP2 wrapper")
    lines = [f"audit: {ev.world_size} rank(s) ({wrapped}), {len(ev.windows)} window(s) after {audit.skip} optimizer "
             f"step(s), judged against {ev.objective.describe()}"]
    worst, clipping = None, []
    assert ev.records is not None
    lows = low_precision(ev, audit) if ev.precision == "bf16" else [None] * len(ev.references)
    bounds = [lp.bound for lp in lows if lp is not None]
    if bounds:
        ev = dataclasses.replace(ev, noise_bound=max(bounds))
    records = ev.records
    assert records is not None
    blind = []
    for k, ref in enumerate(ev.references):
        if ref is None:
            lines.append(f"audit: window {k}: no supervised token, nothing to compare")
            continue
        lp = lows[k]
        if lp is not None and lp.apart < SEPARATION:
            blind.append(f"window {k} ran under {lp.dtype} autocast, whose noise ({lp.noise:.3g}) lets a mean of "
                         f"local means stand only {lp.apart:.2g} bounds from the reference: it would have passed; "
                         "audit windows whose counts differ more (--unbalance), or judge the step in float32")
        for rank, recs in enumerate(records):
            grad = recs[k].grad
            assert grad is not None
            where = f"window {k}" + (f", rank {rank}" if len(records) > 1 else "")
            if lp is None:
                c = compare(grad.float(), ref.gradient.float(), atol=atol, rtol=rtol)
                ok, ratio, summary = c.passed, c.worst_ratio, c.summary()
            else:
                error = relative_l2(grad, ref.gradient)
                ok, ratio = error <= lp.bound, error / lp.bound if lp.bound > 0 else math.inf
                summary = (f"relative L2 error {error:.3g}, bound {lp.bound:.3g} ({ratio:.2g} of it): under "
                           f"{lp.dtype} autocast, {NOISE_MULTIPLE:g} x the noise {lp.noise:.3g} of the correct "
                           "computation replayed under the same autocast")
            lines.append(f"audit: {where}: parity {'PASSED' if ok else 'FAILED'}: {summary}")
            if not ok and (worst is None or ratio > worst[2]):
                worst = (k, rank, ratio)
            clipping += _clip_line(ev, k, rank, where, None if lp is None else lp.bound)
    syncing = _one_sync(audit, others, ev.strategy)
    failed_clips = [line for line in clipping if "FAILED" in line]
    lines += clipping + syncing + [f"  could not show: {spot}" for spot in [*blind_spots(ev), *blind]]
    found = None if worst is None else diagnose(ev, worst[0], worst[1])
    if found is not None:
        lines += [f"  reading ({found.signature.name}): {found.signature.sentence}", f"  fix: {found.fix}"]
    lines += [f"  labels read: {read_labels(ev.windows[0][0][0].call, labels)[1]}"]  # type: ignore[attr-defined]
    lines += [f"  note: {n}" for n in notes] + [f"  problem: {p}" for p in problems]
    passed = worst is None and not syncing and not failed_clips and not problems
    return AuditVerdict(passed, tuple(lines), found, problems)


def _clip_line(ev: Evidence, k: int, rank: int, where: str, bound: float | None = None) -> list[str]:
    """The norm ``rank``'s clip returned in window ``k`` against the reference's global norm before clipping (within
    float32's tolerances, or the relative ``bound`` of a window under autocast)."""
    want = ev.reference_norms[k]
    if ev.max_norm is None or want is None:
        return []
    assert ev.records is not None
    got = ev.records[rank][k].grad_norm
    if got is None:
        return [f"audit: {where}: clipping FAILED: this rank did not call clip_grad_norm_ (max_norm {ev.max_norm:g} "
                "on another rank)"]
    atol, rtol = tolerances(torch.float32)
    if abs(got - want) <= (atol + rtol * want if bound is None else bound * want):
        engaged = "engaged" if want > ev.max_norm else "not engaged"
        return [f"audit: {where}: clipping PASSED: clip_grad_norm_ returned {got:.6g}, the reference's global norm "
                f"(max_norm {ev.max_norm:g}, {engaged})"]
    norm = read_norm(ev, k, rank, got)
    ratio = got / want if want > 0 else math.inf
    return [f"audit: {where}: clipping FAILED: clip_grad_norm_ returned {got:.6g}, {ratio:.4g}x the reference's "
            f"global norm before clipping {want:.6g}: {norm.sentence}"]


def blind_spots(ev: Evidence) -> list[str]:
    """The mistakes the audited windows cannot tell from the right weighting, from their token counts: where every
    rank holds the same count in every window, a mean of local means equals the token mean; where every microbatch
    of a window holds the same count, so does a mean per microbatch. Each names what would show it."""
    out = []
    per_rank = [[sum(mb.supervised for mb in mbs) for mbs in window] for window in ev.windows]
    per_mb = [[mb.supervised for mbs in window for mb in mbs] for window in ev.windows]
    show = ("audit windows whose counts differ (--skip to others), mask labels with --unbalance (its batches' labels "
            "reach the model), or judge the step as a recipe with the battery")
    if ev.world_size > 1 and all(len(set(counts)) == 1 for counts in per_rank):
        out.append(f"every rank held the same token count in every audited window ({per_rank[0][0]} in window 0), so "
                   f"a mean of local means would have passed; {show}")
    several = any(len(mbs) > 1 for window in ev.windows for mbs in window)  # else the line above says it
    if several and all(len(set(counts)) == 1 for counts in per_mb):
        out.append(f"every microbatch held the same token count ({per_mb[0][0]} in window 0), so a mean per "
                   f"microbatch would have passed; {show}")
    return out


def _one_sync(audit: Record, others: Sequence[Record], strategy: str) -> list[str]:
    """One synchronization per window on every DDP or FSDP2 rank: the battery's one_sync check on the counts the watch
    read (nothing where the model is wrapped by neither)."""
    out = []
    for rank, record in enumerate((audit, *others)):
        for k, w in enumerate(record.windows):
            if w.syncs is not None and w.syncs != 1:
                out.append(f"audit: window {k}, rank {rank}: one_sync FAILED: the gradient was synchronized in "
                           f"{w.syncs} of the window's {len(w.calls)} model calls; expected 1")
    if out:
        out.append(f"  fix: {check_fix('one_sync', strategy=strategy)}")
    return out


__all__ = ["AuditVerdict", "LowPrecision", "blind_spots", "evidence", "judge", "low_precision", "objective_of"]
