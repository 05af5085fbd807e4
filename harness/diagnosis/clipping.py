"""What a clipping recipe's numbers say went wrong: the norm it returned, and the gradient it left.

A recipe clips when its ``backward_window`` takes ``max_norm`` (:func:`harness.recipes.contract.clips`); the harness
clips each reference gradient the way ``clip_grad_norm_`` does, by ``f = min(1, max_norm / (norm + 1e-6))``, with
``max_norm`` half the first window's reference norm so that clipping engages. Two readings come out of that:

- **The norm** (the clipping check): the ratio ``rho`` of the returned norm to the reference's global norm, and the
  norm, among those a real mistake computes, that it equals: ``sqrt(W)`` times the global one (squared norms
  all-reduced again after the synchronization: the ranks already hold the same gradient), under HSDP ``sqrt(R)``
  times (squared shard norms summed over the ``R`` replicas as well as the shards), a sum of per-tensor norms,
  the sum of squares without its root, the largest or the last tensor's norm, an L1 or inf norm, the norm of the
  gradient before a factor of the window was applied (a clip before the scale: ``rho`` is ``N/W``, ``N``, ``k``,
  ...), one rank's gradient before the synchronization (its first ``j`` microbatches), or one FSDP2 shard's. Each is
  named only when the number fits it; a norm that fits none is called too large or too small by ``rho``, never the
  other way round.
- **The gradient** (the diagnosis of a failing parity verdict): a gradient equal to the *unclipped* reference reads
  ``clipping_not_applied`` (each tensor clipped alone, so no tensor's norm reached ``max_norm``; a clip on another
  rank; a clip of a copy), one whose tensors over ``max_norm`` were each scaled to it alone ``clipped_per_tensor``,
  and one clipped by the factor of the norm it returned ``clipped_by_wrong_norm`` with that norm's reading. Each is
  read against the unclipped gradient at the weights the rank started the window from (the reference's, or,
  where an earlier window's wrong step moved the rank elsewhere, recomputed there). Without this, a clip that never
  engaged reads as a uniform scale ``1/f`` (2.0 at the first window), which the catalog calls "the world-size factor
  is applied twice".
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.core.compare import compare, flat_grad, tolerances
from harness.diagnosis.evidence import Evidence, first_supervised
from harness.diagnosis.signatures import SIGNATURES, Signature

CLIPPING_SIGNATURES = {
    "clipping_not_applied": "the gradient is the unclipped reference: the clip never engaged (each tensor clipped "
                            "alone, a clip of a copy, a clip on another rank)",
    "clipped_by_wrong_norm": "the gradient was clipped by the norm the recipe returned, which is not the global L2 "
                             "norm of the synchronized gradient",
    "clipped_per_tensor": "each tensor was clipped alone, by its own norm: the tensors over max_norm scaled, the rest "
                          "not",
}
SIGNATURES.update(CLIPPING_SIGNATURES)  # the catalog the controls' declared diagnoses are checked against

NORM_MATCH = 1e-3
"""Largest relative distance of a returned norm from a candidate for the candidate to name it (float32 and float64
lanes; the bf16 lane uses twice its derived bound). A norm of the synchronized float32 gradient sits within about
1e-6 of the float64 one."""


@dataclass(frozen=True)
class NormReading:
    """What a returned norm is: its ratio to the reference's global norm, the candidate it fits (``name``; None: none
    fits) and the sentence."""

    ratio: float
    name: str | None
    sentence: str


def clip_factor(ev: Evidence, window: int) -> float:
    """The factor the reference gradient of ``window`` was clipped by (1.0: no clipping)."""
    norm = ev.reference_norms[window] if window < len(ev.reference_norms) else None
    if ev.max_norm is None or norm is None:
        return 1.0
    return min(1.0, ev.max_norm / (norm + 1e-6))


def _match_tolerance(ev: Evidence) -> float:
    if ev.precision == "bf16" and ev.noise_bound is not None:
        return max(NORM_MATCH, 2 * float(ev.noise_bound))
    return NORM_MATCH


def _window_facts(ev: Evidence, window: int, rank: int) -> list[tuple[str, float]]:
    """Factors of the window a gradient may carry before its last scale: ``(name, value)``, the plain ones first."""
    w = ev.world_size
    mbs = ev.windows[window]
    k = len(mbs[0])
    n = sum(mb.supervised for r in mbs for mb in r)
    own = sum(mb.supervised for mb in mbs[rank])
    facts = [("N", n), ("N/W", n / w), ("N/k", n / k), ("N/(W*k)", n / (w * k)), ("W", w), ("1/W", 1 / w),
             ("k", k), ("1/k", 1 / k), ("W*k", w * k), ("1/(W*k)", 1 / (w * k)), (f"rank {rank}'s own count", own),
             (f"W x rank {rank}'s own count", w * own)]
    return [(name, float(v)) for name, v in facts if v > 0 and not math.isclose(v, 1.0)]


def _per_tensor(ev: Evidence, unclipped: torch.Tensor) -> list[torch.Tensor]:
    sizes = [p.numel() for p in ev.model.build().parameters()]
    return list(torch.split(unclipped, sizes))


def _shard_norms(ev: Evidence, unclipped: torch.Tensor) -> list[float]:
    """Each shard's FSDP2 norm of the gradient: ``fully_shard`` splits every tensor along dim 0 in ``torch.chunk``'s
    way, shard r holding chunk r (none past the last chunk); there is one shard per rank, or under HSDP one per rank
    of a replica (every replica holds the same shards)."""
    shapes = [p.shape for p in ev.model.build().parameters()]
    n = ev.world_size // ev.mesh.size("dp_replicate") if len(ev.mesh.token_dims) > 1 else ev.world_size
    squares = [0.0] * n
    for g, shape in zip(torch.split(unclipped, [math.prod(s) for s in shapes]), shapes):
        chunks = torch.chunk(g.view(shape), n, dim=0) if len(shape) else (g,)
        for r, chunk in enumerate(chunks):
            squares[r] += float(chunk.double().pow(2).sum())
    return [math.sqrt(s) for s in squares]


def _group_norms(ev: Evidence, window: int, rank: int, unclipped: torch.Tensor, want: float,
                 tol: float) -> list[tuple[str, float, str]]:
    """On a mesh of two dimensions or more, the norm a rank gets by summing its local shards' squared norms
    (``grad.to_local()``, each rank's shard as it recorded it) over each group of the mesh's dimensions: over too few
    ranks it misses the shards of the others (torchtune #2420: the tp shards), over too many it counts replicas
    twice. Groups that give the global norm are left out."""
    mesh = ev.mesh
    if len(mesh.names) < 2 or ev.records is None or any(not recs[window].shards for recs in ev.records):
        return []
    shapes = [p.shape for p in ev.model.build().parameters()]
    grads = [g.view(s) for g, s in zip(torch.split(unclipped, [math.prod(s) for s in shapes]), shapes)]
    local_sq = []
    for recs in ev.records:
        total = 0.0
        for g, shard in zip(grads, recs[window].shards):
            part = g if shard is None else g[tuple(slice(o, o + n) for n, o in zip(*shard))]
            total += float(part.double().pow(2).sum())
        local_sq.append(total)
    out = []
    for size in range(len(mesh.names) + 1):
        for dims in itertools.combinations(mesh.names, size):
            members = mesh.group(rank, dims)
            value = math.sqrt(sum(local_sq[r] for r in members))
            if abs(value - want) <= tol * want:
                continue
            over = " x ".join(dims) if dims else "no group (this rank's shards alone)"
            out.append(("local_shard_norm_over_group", value,
                        f"the local shards' squared norms (grad.to_local()) summed over {over} ({len(members)} "
                        f"rank{'s' if len(members) > 1 else ''}) only, {value / want:.4g} times the global norm: the "
                        "group misses the shards other ranks hold, or counts a replicated one twice; take the norm "
                        "clip_grad_norm_ returns, or sum the squares of each gradient's full_tensor()"))
    return out


def _clipped_by_own_norms(ev: Evidence, window: int, rank: int, unclipped: torch.Tensor) -> torch.Tensor | None:
    """On a mesh, the gradient ``rank`` gathers when every rank clipped its own shards by the norm it returned
    itself: each slice of a parameter comes from the rank that holds it and is nearest to ``rank`` on the mesh
    (``rank`` itself where it holds the slice; its peer along the sharded dimension otherwise), scaled by that
    rank's own factor. None without the shards or the norms of every rank."""
    mesh, records = ev.mesh, ev.records
    if len(mesh.names) < 2 or records is None or ev.max_norm is None:
        return None
    recs = [r[window] for r in records]
    if any(not rec.shards or rec.grad_norm is None for rec in recs):
        return None
    factors = [min(1.0, ev.max_norm / (float(rec.grad_norm) + 1e-6)) for rec in recs]  # type: ignore[arg-type]
    here = mesh.coords(rank)
    shapes = [p.shape for p in ev.model.build().parameters()]
    parts = []
    for i, (g, shape) in enumerate(zip(torch.split(unclipped, [math.prod(s) for s in shapes]), shapes)):
        out = g.view(shape).clone()
        holders: dict[tuple[tuple[int, ...], tuple[int, ...]] | None, list[int]] = {}
        for r, rec in enumerate(recs):
            holders.setdefault(rec.shards[i], []).append(r)
        for shard, ranks in holders.items():
            r = min(ranks, key=lambda x: (x != rank, sum(v != here[k] for k, v in mesh.coords(x).items())))
            where = (slice(None),) if shard is None else tuple(slice(o, o + n) for n, o in zip(*shard))
            out[where] = g.view(shape)[where] * factors[r]
        parts.append(out.reshape(-1))
    return torch.cat(parts)


def _presync_norms(ev: Evidence, window: int) -> list[tuple[str, float]]:
    """The norm of each rank's own gradient before the synchronization, after its first j microbatches, for a loss
    scaled right (each microbatch's numerator times W/Z, as a rank's loss under DDP's average is)."""
    from harness.diagnosis import objective as od

    assert ev.records is not None
    rec = ev.records[0][window]
    model = ev.model_at(rec.params_before, torch.float64, first_supervised(ev.windows[window]))
    model.train()
    z = od.normalizer(ev, window)
    out = []
    for r, mbs in enumerate(ev.windows[window]):
        acc = None
        for j, mb in enumerate(mbs):
            if mb.supervised:
                model.zero_grad(set_to_none=True)
                ev.terms(model, mb)[0].backward()
                g = flat_grad(model) * (ev.world_size / z)
                acc = g if acc is None else acc + g
            if acc is not None:
                what = ("all its microbatches" if j == len(mbs) - 1 else
                        "its first microbatch" if j == 0 else f"its first {j + 1} microbatches")
                out.append((f"rank {r}'s gradient before the synchronization ({what})", float(acc.norm())))
    return out


def read_norm(ev: Evidence, window: int, rank: int, got: float) -> NormReading:
    """Name the norm ``got`` that ``rank`` returned in ``window`` against the reference's global norm there."""
    want = ev.reference_norms[window]
    ref = ev.references[window]
    assert want is not None and ref is not None
    rho = got / want if want > 0 else math.inf
    tol = _match_tolerance(ev)
    unclipped = ref.gradient.double() / clip_factor(ev, window)
    tensors = [float(t.norm()) for t in _per_tensor(ev, unclipped)]
    w = ev.world_size
    candidates: list[tuple[str, float, str]] = []
    if w > 1:
        candidates.append(("norm_reduced_again", math.sqrt(w) * want,
                           f"sqrt(W) = {math.sqrt(w):.4g} times the global norm: the squared norm was all-reduced "
                           "(summed over the ranks) after the synchronization, when every rank already held the whole "
                           "gradient; take the norm of the synchronized gradient as it is"))
    replicas = ev.mesh.size("dp_replicate")
    if replicas > 1 and ev.strategy == "fsdp2":
        candidates.append(("norm_over_replicas", math.sqrt(replicas) * want,
                           f"sqrt(dp_replicate) = {math.sqrt(replicas):.4g} times the global norm: under HSDP the "
                           f"squared shard norms were summed over every rank, dp_replicate x dp_shard, when each of "
                           f"the {replicas} replicas holds every shard; sum them over the shard group only "
                           "(harness.recipes.shard_group(mesh)), or take the norm clip_grad_norm_ returns"))
    candidates += [
        ("norm_sum_of_tensor_norms", sum(tensors), "a sum of per-tensor norms, not the global L2 norm (the square "
         "root of the sum of every tensor's squared norm, as clip_grad_norm_ computes it)"),
        ("norm_without_root", sum(t * t for t in tensors), "the sum of squared norms without its square root"),
        ("norm_largest_tensor", max(tensors), "the largest per-tensor norm, not the global L2 norm"),
        ("norm_last_tensor", tensors[-1], "the last tensor's norm (a norm overwritten in a loop over the tensors, each "
         "clipped alone)"),
        ("norm_l1", float(unclipped.abs().sum()), "an L1 norm, not the L2 norm"),
        ("norm_inf", float(unclipped.abs().max()), "the largest component (an inf norm), not the L2 norm"),
    ]
    for name, value in _window_facts(ev, window, rank):
        candidates.append(("clip_before_scale", value * want,
                           f"the norm of the gradient while it was still {name} = {value:.6g} times its final value: a "
                           "clip before the scale (clip after every division and multiplication of the gradient, "
                           "after the synchronization)"))
    if ev.strategy == "fsdp2":
        for r, norm in enumerate(_shard_norms(ev, unclipped)):
            candidates.append(("shard_norm", norm, f"the norm of rank {r}'s FSDP2 shard (grad.to_local()), not the "
                               "global one: clip_grad_norm_ over the DTensor gradients returns the global norm"))
    # A group's norm that a named candidate already gives (HSDP's sum over the replicas) keeps the named one's words.
    candidates += [c for c in _group_norms(ev, window, rank, unclipped, want, tol)
                   if not any(abs(c[1] - v) <= tol * v for _, v, _ in candidates)]
    found = _best(candidates, got, tol)
    if found is None and w > 1:
        found = _best([("pre_sync_norm", v, f"the norm of {what}: a norm taken before the last backward synchronized "
                        "the gradient; clip after it") for what, v in _presync_norms(ev, window)], got, tol)
    if found is not None:
        return NormReading(rho, found[0], found[2])
    if rho > 1:
        why = ("too large: a norm over more than the synchronized gradient (squared norms summed over the ranks again, "
               "a sum of per-tensor norms, a gradient not yet divided by its count), which no candidate the harness "
               "knows fits")
    else:
        why = ("too small: a norm over part of the gradient (one rank's before the synchronization, one shard's, "
               "some tensors only), which no candidate the harness knows fits")
    return NormReading(rho, None, why)


def _best(candidates: Sequence[tuple[str, float, str]], got: float, tol: float) -> tuple[str, float, str] | None:
    close = [(abs(got - v) / v, c) for c in candidates for v in [c[1]] if v > 0 and abs(got - v) <= tol * v]
    return min(close, key=lambda t: t[0])[1] if close else None


def _same(ev: Evidence, got: torch.Tensor, want: torch.Tensor) -> bool:
    if ev.precision == "bf16" and ev.noise_bound is not None:
        norm = float(want.double().norm())
        return norm > 0 and float((got.double() - want.double()).norm()) / norm <= float(ev.noise_bound)
    atol, rtol = tolerances(torch.float64 if ev.precision == "fp64" else torch.float32)
    return compare(got, want.to(got.dtype), atol=atol, rtol=rtol).passed


def _unclipped_truth(ev: Evidence, window: int, rank: int) -> tuple[torch.Tensor, str] | None:
    """The unclipped gradient of the declared objective at the weights ``rank`` started ``window`` from, and where
    that is: the reference's (divided by its clip factor) when the rank started from the reference's weights, else
    recomputed in float64 at the rank's own (an earlier window's step, unclipped, moved them elsewhere)."""
    from harness.diagnosis import objective as od

    assert ev.records is not None
    rec, ref = ev.records[rank][window], ev.references[window]
    if ref is None:
        return None
    start = ev.reference_starts[window] if window < len(ev.reference_starts) else None
    if start is not None and torch.equal(rec.params_before.to(start.dtype), start):
        return ref.gradient.double() / clip_factor(ev, window), "the reference's"
    model = ev.model_at(rec.params_before, torch.float64, first_supervised(ev.windows[window]))
    model.train()
    model.zero_grad(set_to_none=True)
    z = od.normalizer(ev, window)
    for mbs in ev.windows[window]:
        for mb in mbs:
            if mb.supervised:
                (ev.terms(model, mb)[0] / z).backward()
    return flat_grad(model), f"the gradient at rank {rank}'s own starting weights (window {window})"


def gradient_reading(ev: Evidence, window: int, rank: int) -> Signature | None:
    """``clipping_not_applied`` or ``clipped_by_wrong_norm`` where the rank's gradient in ``window`` is the unclipped
    gradient, or the gradient clipped by the norm the rank returned instead of the global one; else None."""
    if ev.max_norm is None or ev.records is None:
        return None
    rec = ev.records[rank][window]
    truth = None if rec.grad is None or ev.objective.auxiliary_unit else _unclipped_truth(ev, window, rank)
    if truth is None:
        return None
    unclipped, where = truth
    norm_before = float(unclipped.norm())
    f = min(1.0, ev.max_norm / (norm_before + 1e-6))
    if f >= 1.0 - _match_tolerance(ev):
        return None
    assert rec.grad is not None
    tensors = _per_tensor(ev, unclipped)
    factors = [min(1.0, ev.max_norm / (float(t.norm()) + 1e-6)) for t in tensors]
    scaled = sum(c < 1.0 for c in factors)
    if scaled and _same(ev, rec.grad, torch.cat([t * c for t, c in zip(tensors, factors)])):
        return Signature("clipped_per_tensor", f"each tensor was clipped alone, by its own norm: {scaled} of "
                            f"{len(tensors)} tensors had a norm over max_norm {ev.max_norm:.6g} and were scaled, the "
                            f"rest kept whole, where clip_grad_norm_ over every parameter together scales all by "
                            f"{f:.4g} ({where} norm {norm_before:.6g}). Clip once, over every parameter together, "
                            "after the synchronization", 1 / f)
    if _same(ev, rec.grad, unclipped):
        return Signature("clipping_not_applied", f"clipping did not take effect (the gradient is the unclipped "
                            f"reference): {where} norm {norm_before:.6g} is over max_norm {ev.max_norm:.6g}, so "
                            f"clip_grad_norm_ scales it by {f:.4g}, and rank {rank}'s gradient was not scaled. Clip on "
                            "every rank, once, over every parameter together, after the synchronization (a tensor "
                            "clipped alone rarely reaches max_norm)", 1 / f)
    got = rec.grad_norm
    if got is None or not got > 0:
        return None
    applied = min(1.0, ev.max_norm / (got + 1e-6))
    if math.isclose(applied, f, rel_tol=_match_tolerance(ev)):
        return None
    if not _same(ev, rec.grad, unclipped * applied):
        mixed = _clipped_by_own_norms(ev, window, rank, unclipped)
        if mixed is None or not _same(ev, rec.grad, mixed):
            return None
    if ev.reference_norms[window] is None or ev.references[window] is None:
        return None
    norm = read_norm(ev, window, rank, got)
    return Signature("clipped_by_wrong_norm", f"clipped by the norm it returned, {norm.ratio:.4g}x the reference's "
                        f"global norm (every weight {applied / f:.4g}x the clipped reference's): {norm.sentence}",
                        applied / f)


def reread(ev: Evidence, found: Any) -> Any:
    """A diagnosis (:class:`harness.diagnosis.result.Diagnosis`) with its signature replaced by the clipping
    reading where one fits its window and rank; the same diagnosis otherwise."""
    if found is None or ev.max_norm is None:
        return found
    sig = gradient_reading(ev, found.window, found.rank)
    return found if sig is None else dataclasses.replace(found, signature=sig)


__all__ = ["CLIPPING_SIGNATURES", "NormReading", "clip_factor", "gradient_reading", "read_norm", "reread"]
