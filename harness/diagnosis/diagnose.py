"""The diagnosis of one window's gradient, computed from :class:`~harness.diagnosis.evidence.Evidence`: the
effective weight of every rank's microbatch, the signature it matches, and the per-parameter view (the fit is
:mod:`harness.diagnosis.fit`, the catalog :mod:`harness.diagnosis.signatures`, the per-parameter view
:mod:`harness.diagnosis.parameter_view`; the result :mod:`harness.diagnosis.result`; the families of readings
:mod:`~harness.diagnosis.objective`, :mod:`~harness.diagnosis.clipping`, :mod:`~harness.diagnosis.pipeline`,
:mod:`~harness.diagnosis.packed`, :mod:`~harness.diagnosis.mesh` and :mod:`~harness.diagnosis.ranks`).

The block gradients are computed in float64 on one device, at the weights the loop started the window from (its
own, right or wrong, so windows after a wrong step are read on their own terms), through the evidence's model and
loss convention (:class:`~harness.diagnosis.evidence.Convention`). The fitted gradient is one rank's synchronized
gradient; the expected one is the block gradients weighted ``1/N``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from harness.core.compare import compare, flat_grad, tolerances
from harness.core.formats import HF, PACKED, to_hf, to_packed
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.diagnosis import clipping
from harness.diagnosis import objective as od
from harness.diagnosis import packed as pd
from harness.diagnosis import ranks as rr
from harness.diagnosis.axes import axes_of
from harness.diagnosis.constant import constant_reading
from harness.diagnosis.evidence import Evidence, first_supervised
from harness.diagnosis.experts import expert_reading, router_cut_off
from harness.diagnosis.fit import (
    EXPLAINED_RESIDUAL,
    MAX_CONDITION,
    Block,
    Fit,
    explained_residual,
    fit_weights,
    match_tolerance,
)
from harness.diagnosis.fixes import fix_for
from harness.diagnosis.loss_parallel import loss_parallel_reading
from harness.diagnosis.mesh import mesh_reading, per_shard_sequence_reading, sharded_sequence_note, token_blocks
from harness.diagnosis.packing import packing_gap
from harness.diagnosis.parameter_view import ParameterRow, locate, parameter_table, residual_shares
from harness.diagnosis.pipeline import pipeline_reading, pipeline_rows_reading
from harness.diagnosis.prompts import prompt_reading
from harness.diagnosis.recipe_level import pattern_fits
from harness.diagnosis.result import Diagnosis
from harness.diagnosis.signatures import Signature, classify, classify_sequences, extra_term_sentence


def worst(ev: Evidence) -> tuple[int, int] | None:
    """``(window, rank)`` whose gradient is furthest from the reference, in tolerance ratios (None: no gradient)."""
    if ev.records is None:
        return None
    best: tuple[float, int, int] | None = None
    for k, ref in enumerate(ev.references):
        if ref is None:
            continue
        for rank in range(ev.world_size):
            if k >= len(ev.records[rank]) or ev.records[rank][k].grad is None:
                continue
            ratio = compare(ev.records[rank][k].grad, ref.gradient).worst_ratio  # type: ignore[arg-type]
            if best is None or not ratio <= best[0]:
                best = (ratio, k, rank)
    return None if best is None else (best[1], best[2])


def _column(ev: Evidence, model: torch.nn.Module, mb: Microbatch) -> torch.Tensor:
    """The gradient of ``mb``'s term of the declared objective's numerator (its loss sum under the token mean)."""
    model.zero_grad(set_to_none=True)
    ev.terms(model, mb)[0].backward()
    return flat_grad(model).double()


def diagnose(ev: Evidence, window: int | None = None, rank: int | None = None,
             per_sequence: bool = False) -> Diagnosis | None:
    """Diagnose one window's gradient on one rank (default: the worst window and rank). None when the run left no
    gradient there (it failed, or the recipe refused the window).

    ``per_sequence`` also fits one weight per row; it is done anyway when the microbatch fit does not explain the
    gradient, to tell a mean per sequence from other damage.
    """
    if window is None or rank is None:
        picked = worst(ev)
        if picked is None:
            return None
        window, rank = (picked[0] if window is None else window), (picked[1] if rank is None else rank)
    if ev.records is None or window >= len(ev.records[rank]):
        return None
    rec = ev.records[rank][window]
    if rec.grad is None:
        return None
    with ev.computing():  # a clipping run: what the clip did is read first (harness.diagnosis.clipping)
        found = clipping.reread(ev, _diagnose(ev, window, rank, per_sequence))
        found = _where_ranks_agreed(ev, window, per_sequence, found) or found
    if found is None:
        return None
    return dataclasses.replace(found, fix=reading_fix(found, ev), clipped=clipping.clip_factor(ev, found.window) < 1)


def _where_ranks_agreed(ev: Evidence, window: int, per_sequence: bool, found: Diagnosis | None) -> Diagnosis | None:
    """A window the ranks started from different weights (an earlier step differed between them: a clip on one rank)
    is no weighting at any one set of weights: the cause is read on the last earlier window they started together,
    on its first rank whose gradient reads wrong, and said so (None: no such window, or the reading stands)."""
    inherited = ("unexplained", "extra_term", "not_reduced_over_group")  # what weights apart make of any mistake
    if found is None or found.signature.name not in inherited or not rr.ranks_apart(ev, window):
        return None
    for j in reversed(range(window)):
        if rr.ranks_apart(ev, j):
            continue
        for r in range(ev.world_size):
            earlier = clipping.reread(ev, _diagnose(ev, j, r, per_sequence))
            if earlier is None or earlier.signature.name in ("correct", "float32_computation"):
                continue
            said = (f"{earlier.signature.sentence} (read on window {j}, rank {r}: the ranks started window {window} "
                    f"from different weights, since window {j}'s steps differed between them)")
            return dataclasses.replace(earlier, signature=dataclasses.replace(earlier.signature, sentence=said))
        return None
    return None


def _weights_edited(ev: Evidence, window: int, rank: int) -> Signature | None:
    """The recipe changed weights up to this window: its gradient is then not a weighting of the reference's blocks at
    the weights the step started from, whatever the fit reads."""
    assert ev.records is not None
    for j, rec in enumerate(ev.records[rank][: window + 1]):
        if rec.weights_changed:
            when = "during this window" if j == window else f"in window {j}"
            names = ", ".join(rec.weights_changed[:4]) + (" ..." if len(rec.weights_changed) > 4 else "")
            return Signature("weights_edited", f"the recipe changed the weights itself {when} ({names}, by up to "
                                f"{rec.weights_touched:.3e}): an in-place weight decay or step inside backward_window; "
                                "the gradient is not read as a weighting (weights_unchanged names the change)")
    return None


def _judged_dtype(ev: Evidence) -> torch.dtype:
    """The dtype whose tolerances parity judges this run at (:func:`harness.battery.judge.checks.parity`): float32 in
    the fp32 lane and where the model computes in float32 inside a float64 run, float64 otherwise."""
    lowered = ev.computes_in == "torch.float32" and ev.precision == "fp64"
    return torch.float32 if ev.precision == "fp32" or lowered else torch.float64


def _live_weights(fit: Fit) -> torch.Tensor:
    return torch.nan_to_num(fit.weights, nan=0.0)


def _carriers(shares: list[tuple[str, float]], cover: float = 0.9, most: int = 4) -> list[tuple[str, float]]:
    """The tensors carrying ``cover`` of the residual, largest first (at most ``most``)."""
    out: list[tuple[str, float]] = []
    total = 0.0
    for name, share in sorted(shares, key=lambda t: -t[1]):
        if total >= cover or len(out) >= most or share <= 0:
            break
        out.append((name, share))
        total += share
    return out


def _extra_term(fit: Fit, a: torch.Tensor, g: torch.Tensor, target: torch.Tensor, names: list[str],
                sizes: list[int], params: list[ParameterRow], precision: str,
                head: str | None = None) -> tuple[Signature, list[ParameterRow]]:
    """``extra_term``: the residual ``g - G w`` as a share of the error ``|g - ref|`` and the tensors carrying it."""
    resid = g - a @ _live_weights(fit)
    err = float((g - target).norm())
    share = float(resid.norm()) / err if err > 0 else math.inf
    shares = residual_shares(resid, names, sizes)
    carried = _carriers(shares)
    where = ", ".join(f"{name} ({s:.1%})" for name, s in carried)
    rest = len([s for _, s in shares if s >= 0.01]) - len(carried)
    where += f" and {rest} more over 1%" if rest > 0 else ""
    base = head or extra_term_sentence(fit.residual, precision)
    sentence = (f"{base}; the residual |g - G w| is {share:.1%} of the error |g - ref|, carried by {where} (shares "
                "of its squared norm)")
    by_name = dict(shares)
    rows = [dataclasses.replace(r, residual_share=by_name.get(r.name)) for r in params]
    return Signature("extra_term", sentence, 1.0, blocks=tuple(n for n, _ in carried)), rows


def _split_extra_term(a: torch.Tensor, g: torch.Tensor, fit: Fit, blocks: list[Block], names: list[str],
                      sizes: list[int], ev: Evidence, rank: int,
                      others: dict[str, int]) -> tuple[Fit, Signature] | None:
    """A large residual that a few tensors carry, whose own gradient is no re-weighting of the blocks: the weights
    are read from the other tensors (``(fit, signature)``), and those tensors hold an extra term. None: the residual
    is spread, or a carrying tensor is itself re-weighted (a parameter never synchronized: the table names it)."""
    resid = g - a @ _live_weights(fit)
    carried = _carriers(residual_shares(resid, names, sizes), cover=0.99, most=max(1, len(names) // 2))
    if sum(s for _, s in carried) < 0.99:
        return None
    offsets = dict(zip(names, [sum(sizes[:i]) for i in range(len(sizes))]))
    size_of = dict(zip(names, sizes))
    keep = torch.ones(g.numel(), dtype=torch.bool)
    for name, _ in carried:
        part = slice(offsets[name], offsets[name] + size_of[name])
        keep[part] = False
        own = fit_weights(a[part], g[part])
        if own.residual <= EXPLAINED_RESIDUAL:
            return None
    clean = fit_weights(a[keep], g[keep])
    if clean.residual > EXPLAINED_RESIDUAL or not clean.condition <= MAX_CONDITION:
        return None
    full = Fit(clean.weights, float((a @ _live_weights(clean) - g).norm() / g.norm()), clean.condition)
    sig = classify(blocks, clean, ev.mesh.token_ranks, ev.precision, rank=ev.mesh.token_rank(rank),
                   other_counts=others)
    if sig.name in ("correct", "float32_computation", "extra_term"):
        words = extra_term_sentence(full.residual, ev.precision)
        return full, Signature("extra_term", words, 1.0, blocks=tuple(n for n, _ in carried))
    named = ", ".join(n for n, _ in carried)
    return full, dataclasses.replace(sig, sentence=f"{sig.sentence}; beside it, an extra term no re-weighting makes "
                                     f"in {named} ({full.residual:.2e} of the gradient)")


def _held_to_verdict(ev: Evidence, window: int, rank: int, g: torch.Tensor, a: torch.Tensor, expected: torch.Tensor,
                     fit: Fit, sig: Signature, params: list[ParameterRow], names: list[str],
                     sizes: list[int], atol: float, rtol: float,
                     fixed: bool = True) -> tuple[Signature, list[ParameterRow]]:
    """The reading held to the verdict's reference and tolerances: never ``correct`` for a gradient parity rejects.

    Where the blocks recomputed here (at the rank's starting weights) do not sum to the reference although the rank
    started from the reference's weights, or one block recomputed twice gives two gradients (``fixed`` False), the
    model is not a fixed function of its inputs: no reading of weights
    holds (``model_not_fixed``). Where the weights read right but the gradient misses, the rest is an extra term.
    """
    ref = ev.references[window] if window < len(ev.references) else None
    if ref is None or sig.name == "nonfinite":
        return sig, params
    ref = dataclasses.replace(ref, gradient=ref.gradient / clipping.clip_factor(ev, window))  # the unclipped truth
    rec = ev.records[rank][window]  # type: ignore[index]
    same_start = window >= len(ev.reference_starts) or torch.equal(ev.reference_starts[window], rec.params_before)
    verdict = compare(g, ref.gradient, atol=atol, rtol=rtol)
    extra = sig.name == "extra_term"
    if verdict.passed:
        if sig.name == "extra_term":
            return Signature("correct", f"the gradient is within the verdict's tolerance of the reference; the fit "
                                f"leaves {fit.residual:.1e} unexplained, under those tolerances", 1.0), params
        return sig, params
    apart = same_start and not compare(expected, ref.gradient, atol=atol, rtol=rtol).passed
    if apart or not fixed:
        gap = float((expected - ref.gradient.double()).norm() / ref.gradient.double().norm())
        what = (f"the blocks' gradients recomputed at the weights rank {rank} started from do not sum to the "
                f"reference ({gap:.2e} apart, beyond the verdict's tolerances)" if apart else
                "the same microbatch recomputed at the same weights gave another gradient")
        return Signature("model_not_fixed", f"{what}: the "
                            "model is not a fixed function of its inputs (a forward that reads a buffer it updates, a "
                            "state carried between calls), so no weighting of the losses is read and the recipe is not "
                            "blamed; check such a model in eval mode, or keep the state out of its forward"), params
    f32_atol, f32_rtol = tolerances(torch.float32)
    f32 = compare(g, ref.gradient, atol=f32_atol, rtol=f32_rtol).passed
    right = sig.name == "correct" or (sig.name == "float32_computation" and not f32)
    if not same_start and (right or sig.name == "float32_computation"):
        here = compare(g, expected, atol=atol, rtol=rtol).passed
        if here or sig.name == "float32_computation":
            starts, records = ev.reference_starts, ev.records[rank]  # type: ignore[index]
            first = next((j for j in range(window) if j + 1 < len(starts)
                          and not torch.equal(starts[j + 1], records[j + 1].params_before)), None)
            where = "an earlier window" if first is None else f"window {first}"
            return Signature("started_elsewhere", f"window {window}'s weighting is right at the weights it started "
                                f"from, but {where}'s step moved them away from the reference's, so parity compares "
                                f"gradients at other weights: read {where}"), params
    if right or extra:
        target = ref.gradient.double() if same_start else expected
        head = None if sig.name != "extra_term" else sig.sentence
        return _extra_term(fit, a, g, target, names, sizes, params, ev.precision, head)
    return sig, params


def _per_rank_notes(ev: Evidence, window: int, rank: int, rows: list[ParameterRow],
                    sizes: list[int]) -> list[ParameterRow]:
    """Name the tensors that hold no gradient on some ranks only (a parameter DDP never synchronized, one a branch
    skipped on those ranks): every rank's synchronized gradient of the window is read, not only the fitted one."""
    assert ev.records is not None
    grads: dict[int, torch.Tensor] = {}
    for r, recs in enumerate(ev.records):
        got = recs[window].grad if window < len(recs) else None
        if got is not None:
            grads[r] = got
    if len(grads) < 2:
        return rows
    out, offset = [], 0
    for row, n in zip(rows, sizes):
        empty = sorted(r for r, gr in grads.items() if n and float(gr[offset : offset + n].abs().max()) == 0)
        offset += n
        if empty and len(empty) < len(grads) and row.note != "no gradient (none expected)":
            which = f"rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))}"
            row = dataclasses.replace(row, note=f"no gradient on {which} only (rank {rank}'s is the one fitted)")
        out.append(row)
    return out


def _diagnose(ev: Evidence, window: int, rank: int, per_sequence: bool) -> Diagnosis | None:
    assert ev.records is not None
    rec = ev.records[rank][window]
    assert rec.grad is not None
    g = rec.grad.double()
    # A clipping run: undo the reference's own clip factor, so that a recipe that clips like the reference reads
    # as its weighting (and one that clips by another factor reads as the scale it applied).
    g = g / clipping.clip_factor(ev, window)
    model = ev.model_at(rec.params_before, torch.float64, first_supervised(ev.windows[window]))
    model.train()
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    columns = []
    zero = torch.zeros(sum(sizes), dtype=torch.float64)
    held = token_blocks(ev, window)
    blocks = [b for b, _ in held]
    for _, mb in held:
        columns.append(_column(ev, model, mb) if mb.supervised else zero)
    a = torch.stack(columns, dim=1)
    n = sum(b.tokens for b in blocks)
    # The right weight of every block is 1/Z, the declared objective's normalizer (N under the token mean); an
    # auxiliary term's columns are fitted beside the blocks', each right at 1/D (harness.diagnosis.objective).
    z = float(n) if ev.objective.plain else od.normalizer(ev, window)
    aux_cols = od.auxiliary_columns(ev, model, window)
    expected = a.sum(dim=1) / z
    if aux_cols is not None:
        expected = expected + aux_cols.sum(dim=1) / ev.objective.auxiliary_denominator(ev.windows[window])
    atol, rtol = tolerances(_judged_dtype(ev))
    # The model as a function: one block recomputed after every other one must give its gradient again.
    first = next((i for i, b in enumerate(blocks) if b.tokens), None)
    fixed = True
    if first is not None:
        again = _column(ev, model, held[first][1])
        fixed = compare(again / n, a[:, first] / n, atol=atol, rtol=rtol).passed
    params = _per_rank_notes(ev, window, rank, parameter_table(g, expected, names, sizes, atol, rtol), sizes)
    location = locate(params)
    common = dict(recipe=ev.recipe, scenario=ev.scenario, world_size=ev.world_size, precision=ev.precision,
                  window=window, rank=rank, blocks=tuple(blocks), parameters=tuple(params), location=location,
                  objective=ev.objective.name, normalizer=None if ev.objective.plain else z)
    aux_fit: torch.Tensor | None = None
    edited: Signature | None = None
    nothing = rr.zero_gradient(ev, window, rank, g, expected)
    if nothing is not None:  # every fitted weight would be 0, which no signature of the fit names
        zeros = tuple(0.0 if b.tokens else math.nan for b in blocks)
        return Diagnosis(signature=nothing, weights=zeros, residual=math.nan, condition=math.nan,
                         **common)  # type: ignore[arg-type]
    if not bool(torch.isfinite(g).all()):
        bad = int((~torch.isfinite(g)).sum())
        sig = Signature("nonfinite", f"rank {rank}'s synchronized gradient holds NaN or inf in {bad} of "
                           f"{g.numel()} components: a division by a zero count (an empty rank or microbatch) reached "
                           "the loss; skip the division when the count is zero, or use a masked sum")
        nan = tuple(math.nan for _ in blocks)
        return Diagnosis(signature=sig, weights=nan, residual=math.nan, condition=math.nan, **common)  # type: ignore[arg-type]
    if aux_cols is None:
        fit = fit_weights(a, g)
    else:
        joint = fit_weights(torch.cat([a, aux_cols], dim=1), g)
        k = a.shape[1]
        # The main blocks' weights come from the joint fit, as if the auxiliary term's part were out of the gradient.
        fit, aux_fit = Fit(joint.weights[:k], joint.residual, joint.condition), od.held(joint.weights[k:], aux_cols)
    # classify reads ratios w * (its blocks' token count): scaled so that they read w * Z, the declared objective's.
    read = fit if z == n else Fit(fit.weights * (z / n), fit.residual, fit.condition)
    others = {f"window {j}'s global count": sum(mb.supervised for mbs in w for mb in mbs)
              for j, w in enumerate(ev.windows) if j != window}
    # (packed: its separator puts IGNORE_INDEX at every sequence's first position, so its count before the shift is
    # the right one and names nothing; its rows' real tokens do; its per-row columns are the microbatches' rows, the
    # sequences unpacked)
    if ev.batch_format == HF:
        before = sum(int((to_hf(mb)["labels"] != IGNORE_INDEX).sum()) for mbs in ev.windows[window] for mb in mbs)
        others["the hf labels counted before the shift (one token more per row without a prompt)"] = before
    if ev.batch_format == PACKED:
        real = sum(int((to_packed(mb)["input_ids"] != PAD).sum()) for mbs in ev.windows[window] for mb in mbs)
        others["the packed rows' real tokens, an attention mask's sum or the rows' lengths, which count each "
               "sequence's first position and its prompt"] = real
    mesh = ev.mesh
    token_world, token_rank = mesh.token_ranks, mesh.token_rank(rank)
    sig = classify(blocks, read, token_world, ev.precision, rank=token_rank, other_counts=others,
                   layout=axes_of(ev, window, rank))
    sig = pipeline_reading(ev, window, blocks, read, mesh_reading(sig, blocks, read, mesh))
    sig = pd.count_reading(ev, window, read, sig) or sig  # packed: a count that takes the boundaries for targets
    if sig.name == "unexplained" and aux_cols is None:  # packed: the pairs across sequences, fitted beside
        across = pd.boundary_reading(ev, model, window, a, g, blocks, [mb for _, mb in held], rank, others)
        if across is not None:
            fit, sig = across
    if sig.name == "unexplained" and aux_cols is None:  # the prompt positions' loss, fitted beside
        prompted = prompt_reading(ev, model, a, g, blocks, [mb for _, mb in held], rank, others)
        if prompted is not None:
            fit, sig = prompted
    if (sig.name == "unexplained" and fit.residual > EXPLAINED_RESIDUAL and fit.condition <= MAX_CONDITION
            and aux_cols is None):
        split = _split_extra_term(a, g, fit, blocks, names, sizes, ev, rank, others)
        if split is not None:
            fit, sig = split
    edited = _weights_edited(ev, window, rank)
    apart = rr.ranks_disagree(ev, window, rank, names, sizes, atol, rtol)
    redone = [mb for _, mb in held if mb.supervised]  # the main term again (an MoE's gates detached: router_cut_off)
    grouped = expert_reading(ev.model_path, model, mesh, g, expected, names, sizes, atol, rtol) or router_cut_off(
        model, g, lambda: expected + (sum(_column(ev, model, mb) for mb in redone) - a.sum(dim=1)) / z, atol, rtol)
    if grouped is not None and edited is None:  # experts, routers and the rest read apart (harness.diagnosis.experts)
        sig, apart = grouped, None
    if edited is not None:
        sig = edited
    elif apart is not None and sig.name in ("unexplained", "extra_term"):
        sig = apart
    else:
        sig, params = _held_to_verdict(ev, window, rank, g, a, expected, fit, sig, params, names, sizes, atol, rtol,
                                       fixed)
        common["parameters"] = tuple(params)
    seq_sig, seq_resid = None, None
    if per_sequence or sig.name == "unexplained":
        rows, cols, parts = [], [], []
        for b, mb in held:
            for i in range(mb.inputs.shape[0]):
                row = mb.row(i)
                rows.append(dataclasses.replace(b, tokens=row.supervised, row=i, rows=0))
                cols.append(_column(ev, model, row) if row.supervised else zero)
                parts.append((row, cols[-1]))
        shard = per_shard_sequence_reading(ev, window, parts, g) if sig.name == "unexplained" else None
        if shard is not None:
            sig = shard
        seq_fit = fit_weights(torch.stack(cols, dim=1), g)
        seq_resid = seq_fit.residual
        # On a pipeline, the schedule's own chunks of rows first: a mean per chunk of one row is a sequence mean too.
        # A packed run's packs next: a mean per packed row is a mean over groups of sequences.
        seq_sig = (pipeline_rows_reading(ev, window, rows, seq_fit) or pd.pack_reading(ev, window, rows, seq_fit)
                   or classify_sequences(rows, seq_fit) or od.row_reading(ev, window, rows, seq_fit))
        if seq_sig is not None and sig.name == "unexplained":
            sig = seq_sig
    if edited is None:  # the declared objective's readings: another objective, the quantity divided by, the aux term
        # Per-rank readings need weights the microbatch fit explains (a reading of the rows' fit keeps its own).
        q = [float(w) * z if fit.residual <= explained_residual() else math.nan for w in fit.weights]
        sig = od.objective_reading(ev, window, model, sig, blocks, q, g, atol, rtol)
        sig = loss_parallel_reading(ev, window, model, sig, g, atol, rtol) or constant_reading(ev, sig) or sig
        # (a scale of 1 within a match is the main loss right, its weights read less exactly beside the term's)
        unit = sig.name == "global_scale" and sig.factor is not None and abs(sig.factor - 1) <= match_tolerance()
        if aux_fit is not None and (unit or sig.name in ("correct", "extra_term", "float32_computation",
                                                         "unexplained")):
            sig = od.auxiliary_reading(ev, window, aux_fit) or sig
    if sig.name == "unexplained":
        sig = sharded_sequence_note(ev, sig, window, model, g)
    if ev.batch_format == PACKED and sig.name not in ("nonfinite", "weights_edited"):
        # The reference is the sequences unpacked: a model whose packed forward is another function is the cause,
        # whatever weighting its gradient happens to fit, and the recipe is not blamed.
        crossing = packing_gap(model, name=f"model={ev.model_path!r}" if ev.model_path else "the built-in model")
        if crossing.crosses:
            sig = Signature("packing_crosses_boundaries", str(crossing.note()))
    aux_weights = () if aux_fit is None else tuple(float(u) for u in aux_fit)
    fits = pattern_fits(blocks, read, token_world) if ev.objective.plain and aux_fit is None else ()
    return Diagnosis(signature=sig, weights=tuple(float(w) for w in fit.weights), residual=fit.residual,
                     condition=fit.condition, sequence_signature=seq_sig, sequence_residual=seq_resid,
                     auxiliary_weights=aux_weights, fits=fits, **common)  # type: ignore[arg-type]


def reading_fix(reading: object, ev: Evidence) -> str:
    """The fix of a reading (a diagnosis, a Signature, a name) in the words of the evidence's strategy, declared
    objective and mesh (:func:`harness.diagnosis.fixes.fix_for`)."""
    return fix_for(reading, strategy=ev.strategy, objective=ev.objective.name, mesh=ev.mesh)


__all__ = ["diagnose", "reading_fix", "worst"]
