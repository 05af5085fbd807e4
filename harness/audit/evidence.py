"""An audit's record as the diagnosis's evidence, and its verdict.

Each recorded call becomes a :class:`~harness.core.microbatch.Microbatch`: its ``input_ids``, and its ``labels`` in the
Hugging Face convention (unshifted, -100 ignored; the model shifts them in its loss) aligned to the positions that
predict them. The reference is the single-device gradient of the global token mean over every call of the window,
in float64, through a copy of the script's own model at the weights the window started from, dropout off
(:func:`harness.model.disable_dropout`); parity compares the gradient the optimizer was about to use with it, at
float32's tolerances, and a failing window is read by :func:`harness.diagnosis.diagnose.diagnose`, the same reading
and fix the battery gives.

What this form audits today: one process (a loop with accumulation), a causal LM called with ``input_ids`` and
``labels`` (and, if any, a right-padded ``attention_mask``: a causal model's real positions never see the padding
after them, so the reference forwards the rows whole). A batch padded on the left, or labels on padded positions,
is named and not judged.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from harness.audit.record import Call, Record
from harness.core.compare import compare, flat_grad, tolerances
from harness.core.formats import HARNESS, logits_of
from harness.core.loss import loss_sum
from harness.core.mesh import Mesh
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.core.reference import Reference
from harness.diagnosis.diagnose import diagnose
from harness.diagnosis.evidence import Evidence, RankWindow, model_at
from harness.diagnosis.fixes import check_fix
from harness.diagnosis.result import Diagnosis
from harness.model import disable_dropout


@dataclass(frozen=True)
class ScriptModel:
    """The script's own model as the diagnosis's :class:`~harness.diagnosis.evidence.Convention`: a copy of it, dropout
    off, in train mode, called with ``input_ids`` alone; the loss sum of the aligned labels."""

    template: nn.Module
    path: str | None = None
    batch_format: str = HARNESS

    def build(self) -> nn.Module:
        model = disable_dropout(copy.deepcopy(self.template))
        model.train()
        return model

    def logits(self, model: nn.Module, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
        raw = logits_of(model(input_ids=mb.inputs))
        return raw, raw

    def loss_sum(self, model: nn.Module, mb: Microbatch) -> torch.Tensor:
        return loss_sum(self.logits(model, mb)[1], mb.labels)

    def reference_batch(self, mb: Microbatch) -> object:
        return mb


def microbatch(call: Call) -> Microbatch:
    """A call's batch as a Microbatch: ``labels[:, t + 1]`` is what position ``t`` predicts. ValueError naming what
    the audit cannot read yet (no labels, left padding, labels on padded positions)."""
    if call.labels is None:
        msg = ("the model was called without labels: the audit reads the labels the model is given (a Hugging Face "
               "causal LM's labels=...)")
        raise ValueError(msg)
    ids, labels = call.input_ids.long(), call.labels.long()
    if ids.dim() != 2 or labels.shape != ids.shape:
        msg = f"input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} must both be [B, T]"
        raise ValueError(msg)
    aligned = torch.full_like(labels, IGNORE_INDEX)
    aligned[:, :-1] = labels[:, 1:]
    mask = call.attention_mask
    if mask is not None:
        real = mask.bool()
        if bool((real[:, 1:] & ~real[:, :-1]).any()):
            msg = ("a row of the attention_mask is padded on the left (or has holes): the audit reads right-padded "
                   "batches only, where a causal model's real positions never see the padding")
            raise ValueError(msg)
        if bool((aligned[~real] != IGNORE_INDEX).any()):
            msg = "labels are set on padded positions: the audit reads batches whose padding is labelled -100"
            raise ValueError(msg)
    return Microbatch(ids, aligned)


@dataclass(frozen=True)
class AuditVerdict:
    """Parity of each audited window against the single-device reference, with the worst window's reading."""

    passed: bool
    lines: tuple[str, ...]
    diagnosis: Diagnosis | None = None
    problems: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return "\n".join(self.lines)


def evidence(audit: Record, others: Sequence[Record] = ()) -> Evidence:
    """The audit's windows as :class:`~harness.diagnosis.evidence.Evidence`: ``audit`` is rank 0's record (it holds
    the model), ``others`` the other ranks' in rank order (none: one process); each window's reference is computed
    here over every rank's calls. ValueError where a window cannot be read."""
    ranks = [audit, *others]
    if audit.model is None or not audit.windows:
        msg = (f"no optimizer step was recorded: the loop stepped {audit.steps} time(s), and the audit waits for "
               f"{audit.skip} step(s) to pass and then {audit.wanted} more, each after a call of the model")
        raise ValueError(msg)
    if len({len(r.windows) for r in ranks}) != 1:
        msg = f"the ranks recorded {[len(r.windows) for r in ranks]} windows: they did not step together"
        raise ValueError(msg)
    convention = ScriptModel(audit.model)
    windows: list[list[list[Microbatch]]] = []
    references: list[Reference | None] = []
    for k, w in enumerate(audit.windows):
        per_rank = [[microbatch(c) for c in r.windows[k].calls] for r in ranks]
        windows.append(per_rank)
        references.append(_reference(convention, w.start, [mb for mbs in per_rank for mb in mbs]))
    records = [[RankWindow(grad=w.grad, params_before=w.start, syncs=1 if w.syncs is None else w.syncs)
                for w in r.windows] for r in ranks]
    return Evidence(windows=windows, records=records, model=convention, mesh=Mesh.data_parallel(len(ranks)),
                    references=references, reference_starts=[w.start for w in audit.windows], precision="fp32",
                    recipe=f"the script's {type(audit.model).__name__}", scenario="its own data")


def _reference(convention: ScriptModel, start: torch.Tensor, mbs: Sequence[Microbatch]) -> Reference | None:
    """The global token mean's gradient over ``mbs`` at the flat weights ``start``, in float64."""
    n = sum(mb.supervised for mb in mbs)
    if n == 0:
        return None
    model = model_at(convention, start, torch.float64)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in mbs:
        if mb.supervised:
            part = convention.loss_sum(model, mb)
            (part / n).backward()
            total += float(part.detach())
    return Reference(gradient=flat_grad(model).to(start.dtype), loss=total / n, tokens=n)


def judge(audit: Record, others: Sequence[Record] = ()) -> AuditVerdict:
    """Each audited window's gradient on every rank against its reference; the worst failing one read by the
    diagnosis."""
    problems = tuple(p for r in (audit, *others) for p in r.problems)
    try:
        ev = evidence(audit, others)
    except ValueError as exc:
        return AuditVerdict(False, (f"audit: not judged: {exc}",), problems=(*problems, str(exc)))
    atol, rtol = tolerances(torch.float32)
    lines, worst = [], None
    assert ev.records is not None
    for k, ref in enumerate(ev.references):
        if ref is None:
            lines.append(f"audit: window {k}: no supervised token, nothing to compare")
            continue
        for rank, recs in enumerate(ev.records):
            grad = recs[k].grad
            assert grad is not None
            c = compare(grad.float(), ref.gradient.float(), atol=atol, rtol=rtol)
            where = f"window {k}" + (f", rank {rank}" if len(ev.records) > 1 else "")
            lines.append(f"audit: {where}: parity {'PASSED' if c.passed else 'FAILED'}: {c.summary()}")
            if not c.passed and (worst is None or c.worst_ratio > worst[2]):
                worst = (k, rank, c.worst_ratio)
    syncing = _one_sync(audit, others)
    lines += syncing + [f"  could not show: {blind}" for blind in blind_spots(ev)]
    found = None if worst is None else diagnose(ev, worst[0], worst[1])
    if found is not None:
        lines += [f"  reading ({found.signature.name}): {found.signature.sentence}", f"  fix: {found.fix}"]
    lines += [f"  note: {p}" for p in problems]
    return AuditVerdict(worst is None and not syncing and not problems, tuple(lines), found, problems)


def blind_spots(ev: Evidence) -> list[str]:
    """The mistakes the audited windows cannot tell from the right weighting, from their token counts: where every
    rank holds the same count in every window, a mean of local means equals the token mean; where every microbatch
    of a window holds the same count, so does a mean per microbatch."""
    out = []
    per_rank = [[sum(mb.supervised for mb in mbs) for mbs in window] for window in ev.windows]
    per_mb = [[mb.supervised for mbs in window for mb in mbs] for window in ev.windows]
    if ev.world_size > 1 and all(len(set(counts)) == 1 for counts in per_rank):
        out.append(f"every rank held the same token count in every audited window ({per_rank[0][0]} in window 0), so "
                   "a mean of local means would have passed; audit windows whose ranks' counts differ (--skip to "
                   "others), or judge the step as a recipe with the battery")
    if all(len(set(counts)) == 1 for counts in per_mb):
        out.append(f"every microbatch held the same token count ({per_mb[0][0]} in window 0), so a mean per "
                   "microbatch would have passed; audit windows with microbatches of different counts, or judge the "
                   "step as a recipe with the battery")
    return out


def _one_sync(audit: Record, others: Sequence[Record]) -> list[str]:
    """One synchronization per window on every DDP rank: the battery's one_sync check on the counts the watch read
    (nothing where the model is not wrapped by DDP)."""
    out = []
    for rank, record in enumerate((audit, *others)):
        for k, w in enumerate(record.windows):
            if w.syncs is not None and w.syncs != 1:
                out.append(f"audit: window {k}, rank {rank}: one_sync FAILED: DDP synchronized {w.syncs} of the "
                           f"window's {len(w.calls)} model calls; expected 1")
    if out:
        out.append(f"  fix: {check_fix('one_sync')}")
    return out


__all__ = ["AuditVerdict", "ScriptModel", "blind_spots", "evidence", "judge", "microbatch"]
