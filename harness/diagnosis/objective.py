"""The diagnosis's readings of the declared objective (:mod:`harness.core.objectives`): the expected weights come from
the objective's own normalizer, a gradient that is exactly another declared objective's is named as that objective,
and an auxiliary term's fitted weight is read against its unit's.

:mod:`harness.diagnosis.diagnose` fits each microbatch's gradient of the objective's numerator term (the plain loss sum
under the token mean), so that the right weight of every block is ``1/Z``; where the recipe declares an auxiliary term,
each microbatch's auxiliary gradient is one more column of the same fit, whose right weight is ``1/D`` (D: every
microbatch of the window, or N for a per-token term).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from harness.core import objectives as ob
from harness.core.compare import compare, flat_grad
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.core.router_terms import bind
from harness.diagnosis import auxiliary_units as au
from harness.diagnosis.count_groups import dims_words
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.fit import MATCH_TOLERANCE, Block, Fit, explained_residual
from harness.diagnosis.row_weights import merge_chunks, read_rows
from harness.diagnosis.signatures import Signature

AUX_TOLERANCE = 1e-3
"""Largest relative deviation of an auxiliary term's fitted ratio from a named factor (its columns are fitted beside
the main blocks', a little less accurately)."""

KEPT = frozenset({"correct", "float32_computation", "nonfinite", "weights_edited", "model_not_fixed",
                  "started_elsewhere", "not_synchronized", "dropped", "double_counted", "per_pack_mean",
                  "shifted_across_boundaries"})
"""Readings an objective reading never replaces: they are right, or name what no objective explains."""


def normalizer(ev: Evidence, window: int) -> float:
    """``Z`` of the declared objective over the run's window ``window`` (the supervised count under the token mean)."""
    return ev.objective.window_normalizer(ev.windows[window])


def auxiliary_columns(ev: Evidence, model: torch.nn.Module, window: int) -> torch.Tensor | None:
    """``[components, microbatches]``: each microbatch's gradient of its auxiliary value (None: no auxiliary term)."""
    if ev.objective.auxiliary_unit is None:
        return None
    held = [mb for mbs in ev.windows[window] for mb in mbs]
    finish = bind(ev.objective.auxiliary_unit, lambda mb: ev.terms(model, mb)[1], held)
    cols = []
    for mb in held:
        model.zero_grad(set_to_none=True)
        aux = finish(ev.terms(model, mb)[1])
        assert aux is not None
        aux.backward()
        cols.append(flat_grad(model))
    return torch.stack(cols, dim=1)


def held(weights: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The auxiliary term's fitted weights, NaN where its column is 0 (a microbatch whose term has no gradient, e.g.
    a router term over a microbatch without a supervised token): such a weight is the fit's free choice, not a
    reading."""
    empty = columns.abs().amax(dim=0) == 0
    return torch.where(empty, torch.full_like(weights, math.nan), weights)


def _gradient(ev: Evidence, objective: ob.Objective, model: torch.nn.Module, windows: Sequence[Sequence[Microbatch]]
              ) -> torch.Tensor:
    """The single-device gradient of ``objective`` over one global window at the model's weights."""
    z = objective.window_normalizer(windows)
    d = objective.auxiliary_denominator(windows) if objective.auxiliary_unit else 1.0
    finish = bind(objective.auxiliary_unit, lambda mb: ev.terms(model, mb, objective)[1],
                  [mb for rank in windows for mb in rank])
    model.zero_grad(set_to_none=True)
    for rank in windows:
        for mb in rank:
            term, value = ev.terms(model, mb, objective)
            aux = finish(value)
            (term / z if aux is None else term / z + aux / d).backward()
    return flat_grad(model)


def alternatives(objective: ob.Objective, windows: Sequence[Sequence[Microbatch]]) -> list[ob.Objective]:
    """The other declared objectives this window can be judged under: every one, ``fixed_normalizer`` where the
    recipe declares its constant (``normalizer``). Drawn weights belong to the weighted
    token mean (the others read the plain loss); advantages belong to the loss (kept under every normalization)."""
    weighted = any(mb.weights is not None for rank in windows for mb in rank)
    out = []
    for name in (ob.TOKEN_MEAN, ob.SEQUENCE_MEAN, ob.WEIGHTED_TOKEN_MEAN):
        if name == objective.name:
            continue
        if name == ob.WEIGHTED_TOKEN_MEAN and (not weighted or objective.weights == ob.ADVANTAGES):
            continue
        weights = objective.weights if objective.weights == ob.ADVANTAGES else (ob.WEIGHTS if name ==
                                                                               ob.WEIGHTED_TOKEN_MEAN else None)
        alt = dataclasses.replace(objective, name=name, weights=weights)
        if alt.window_normalizer(windows) > 0:
            out.append(alt)
    if objective.name != ob.FIXED_NORMALIZER and objective.normalizer is not None:  # a constant the recipe declares
        out.append(dataclasses.replace(objective, name=ob.FIXED_NORMALIZER,
                                       weights=objective.weights if objective.weights == ob.ADVANTAGES else None))
    return out


def other_objective(ev: Evidence, model: torch.nn.Module, window: int, g: torch.Tensor, atol: float,
                    rtol: float) -> Signature | None:
    """``other_objective`` when ``g`` is, within the verdict's tolerances, the gradient of another declared objective
    over the same window: "this gradient is the sequence mean"."""
    windows = ev.windows[window]
    for alt in alternatives(ev.objective, windows):
        expected = _gradient(ev, alt, model, windows)
        if compare(g, expected, atol=atol, rtol=rtol).passed:
            # What to do (judge it with --objective=X, or normalize by the declared quantity) is its fix
            # (harness.diagnosis.fix_catalog): a layout whose counts cannot tell this reading from another must not
            # advise the option.
            sentence = (f"this gradient is {alt.describe()}, not {ev.objective.describe()}, the declared objective: "
                        f"the recipe normalizes by {ob.QUANTITIES[alt.name]}")
            return Signature("other_objective", sentence, 1.0, objective=alt.name)
    return None


def _quantities(ev: Evidence, window: int) -> list[tuple[float, str]]:
    """Every global quantity a recipe may have divided the window by: each objective's all-reduced one, and the
    declared constant."""
    windows = ev.windows[window]
    weighted = any(mb.weights is not None for rank in windows for mb in rank)
    out = []
    for name in (ob.TOKEN_MEAN, ob.SEQUENCE_MEAN, ob.WEIGHTED_TOKEN_MEAN):
        if name == ob.WEIGHTED_TOKEN_MEAN and not weighted:
            continue
        value = sum(ob.share(name, mb) for rank in windows for mb in rank)
        out.append((value, f"{ob.QUANTITIES[name]} ({value:g})"))
    if ev.objective.normalizer is not None:
        out.append((float(ev.objective.normalizer), f"the declared constant ({ev.objective.normalizer:g})"))
    return out


def wrong_normalizer(ev: Evidence, window: int, c: float) -> Signature | None:
    """``wrong_normalizer`` when a common scale ``c`` on every weight is the declared normalizer over another
    quantity of the window (the recipe divided by that one)."""
    if not math.isfinite(c) or c <= 0:
        return None
    z = normalizer(ev, window)
    used = z / c
    declared = f"{ob.QUANTITIES[ev.objective.name]} ({z:g})"
    for value, words in _quantities(ev, window):
        if value > 0 and value != z and abs(used / value - 1) <= MATCH_TOLERANCE:
            return Signature("wrong_normalizer", f"the window was divided by {words} where {ev.objective.name} "
                                f"divides by {declared}: every weight is {c:.4g}x the right one; all-reduce "
                                f"{ob.QUANTITIES[ev.objective.name]} before any backward, not "
                                f"{words.split(' (')[0]}", c)
    return None


def rank_facts(ev: Evidence, window: int) -> list[tuple[str, dict[int, float], bool]]:
    """What each rank of the window holds that a rank may have divided its own loss by, from the window's own data:
    ``(words, {rank: value}, own_share)``; ``own_share`` marks the rank's part of an objective's quantity (its count,
    its sequences, its weight sum), whose division per rank is a mean of local means."""
    windows = ev.windows[window]

    def each(value: Callable[[Sequence[Microbatch]], float]) -> dict[int, float]:
        return {r: float(value(mbs)) for r, mbs in enumerate(windows)}

    out = [("its own count (its supervised tokens)", each(lambda w: sum(mb.supervised for mb in w)), True),
           ("its own count of sequences with a supervised token",
            each(lambda w: sum(ob.share(ob.SEQUENCE_MEAN, mb) for mb in w)), True)]
    if any(mb.weights is not None for rank in windows for mb in rank):
        out.append(("its own weight sum", each(lambda w: sum(ob.share(ob.WEIGHTED_TOKEN_MEAN, mb) for mb in w)), True))
    out += [("its own row count (its batch size)", each(lambda w: sum(int(mb.inputs.shape[0]) for mb in w)), False),
            ("its own padded length (the longest row of its batch, labels.size(1))",
             each(lambda w: max(int(mb.labels.shape[1]) for mb in w)), False),
            ("its own padded positions (rows x padded length)", each(lambda w: sum(mb.labels.numel() for mb in w)),
             False)]
    return out


def per_rank_normalizer(ev: Evidence, window: int, blocks: Sequence[Block], q: Sequence[float]) -> Signature | None:
    """Every rank's blocks share one ratio to the right weight and ranks differ: each rank divided by a normalizer
    of its own. Its divisor ``Z / ratio`` is named by the rank's own quantity it is proportional to (its count: a
    mean of local means, ``mean_of_local_means``; its rows or padded length: ``per_rank_normalizer``)."""
    by_rank: dict[int, list[float]] = {}
    for b, v in zip(blocks, q):
        if b.tokens > 0 and math.isfinite(v):
            by_rank.setdefault(b.rank, []).append(v)
    if len(by_rank) < 2:
        return None
    means = {}
    for r, values in by_rank.items():
        top = max(abs(v) for v in values)
        if top == 0 or max(values) - min(values) > MATCH_TOLERANCE * top:
            return None
        means[r] = sum(values) / len(values)
    if max(means.values()) - min(means.values()) <= MATCH_TOLERANCE * max(abs(v) for v in means.values()):
        return None
    z = normalizer(ev, window)
    divisors = {r: z / v for r, v in means.items()}  # what each rank's tokens were effectively divided by
    lo, hi = min(means, key=means.__getitem__), max(means, key=means.__getitem__)
    for words, held, own_share in rank_facts(ev, window):
        ratios = [divisors[r] / held[r] for r in divisors if held.get(r)]
        if len(ratios) != len(divisors) or len({held[r] for r in divisors}) < 2:
            continue
        c = sum(ratios) / len(ratios)
        if max(abs(x / c - 1) for x in ratios) > MATCH_TOLERANCE:
            continue
        w = ev.world_size
        if abs(c / w - 1) <= MATCH_TOLERANCE:
            how = f"each rank divided its loss by {words}, and DDP averaged over the W={w} ranks"
        else:
            how = f"each rank's tokens were divided by {c:.4g} x {words} (W={w})"
        weigh = f"rank {hi}'s tokens weigh {means[hi] / means[lo]:.2g}x rank {lo}'s"
        if own_share:
            return Signature("mean_of_local_means", f"each rank's tokens weigh 1/(W * {words.split(' (')[0]}): "
                                f"{how}: a mean of local means; {weigh}", c / ev.world_size)
        return Signature("per_rank_normalizer", f"{how}, where {ev.objective.name} divides every rank by "
                            f"{ob.QUANTITIES[ev.objective.name]} ({z:g}): {weigh}",
                            blocks=tuple(f"rank {r}" for r in sorted(means)))
    parts = "; ".join(f"rank {r} weighs {v:.4g}x the right weight (divided by {z / v:.4g})"
                      for r, v in sorted(means.items())[:4])
    return Signature("per_rank_normalizer", f"each rank's tokens weigh their own factor: {parts}, where "
                        f"{ev.objective.name} divides every rank by {ob.QUANTITIES[ev.objective.name]} ({z:g}): "
                        "each rank divided by a normalizer of its own that no count, row count or padded length of "
                        "its batch is proportional to", blocks=tuple(f"rank {r}" for r in sorted(means)))


def row_reading(ev: Evidence, window: int, rows: Sequence[Block], fit: Fit) -> Signature | None:
    """What the per-sequence view's fitted weights compute, under the declared objective: each row's weight turned
    into its tokens' weight (times ``1/n_s`` where the objective's term of a row is its sequence's mean, ``n_s`` the
    whole sequence's count: a cp chunk's column divides by it, :func:`harness.diagnosis.mesh.token_blocks`), read as
    a mean over a group of tokens (:func:`harness.diagnosis.row_weights.read_rows`). Under cp a count local to a data
    rank is read first, over whole rows (:func:`harness.diagnosis.row_weights.merge_chunks`), then one local to a
    token rank, over chunks. None where that view leaves a residual."""
    if fit.residual > explained_residual():
        return None
    whole = _whole_counts(ev, window, rows)
    seq = ev.objective.name == ob.SEQUENCE_MEAN
    per_token = [float(u) / (n if seq and n else 1) for n, u in zip(whole, fit.weights)]
    k = max(len(rank) for rank in ev.windows[window])
    declared = f"{ev.objective.name} is {ev.objective.describe()}"
    mesh, cp = ev.mesh, ev.mesh.size("cp")
    if cp < 2:
        return read_rows(rows, per_token, ev.world_size, k, fit.residual, declared)
    merged = merge_chunks(rows, per_token, whole, cp)
    found = None if merged is None else read_rows(*merged, mesh.data_ranks, k, fit.residual, declared)
    if found is not None:
        where = (f"a rank is a data rank (W={mesh.data_ranks}: its cp ranks hold the same rows) and a row's length "
                 "its count over every chunk")
    else:
        found = read_rows(rows, per_token, mesh.token_ranks, k, fit.residual, declared)
        where = (f"a rank is a token rank (W={mesh.token_ranks}, dp x cp: each counted the sequences of its own "
                 "chunk) and a row's length its chunk's count (each cp rank divided its chunk of a sequence by the "
                 "chunk's own count, as per_shard_sequence_mean does)")
    if found is None:
        return None
    return dataclasses.replace(found, sentence=f"{found.sentence}; on this cp mesh {where}")


def _whole_counts(ev: Evidence, window: int, rows: Sequence[Block]) -> list[int]:
    """Each row's supervised count over every chunk of it (its own count without cp): a row block's ``rank`` is its
    token rank, data rank x cp + cp rank (:func:`harness.diagnosis.mesh.token_blocks`)."""
    cp = ev.mesh.size("cp")
    if cp < 2:
        return [b.tokens for b in rows]
    out = []
    for b in rows:
        mb = ev.windows[window][b.rank // cp][b.microbatch]
        counts = mb.counts if mb.counts is not None else (mb.labels != IGNORE_INDEX).sum(dim=1)
        out.append(int(counts[b.row or 0]))
    return out


def auxiliary_reading(ev: Evidence, window: int, u: torch.Tensor) -> Signature | None:
    """The auxiliary term's fitted weights ``u`` (one per microbatch) read against its unit's ``1/D``: None when
    right, else the signature of the mistake (scaled by the main loss's token normalization, divided by the
    microbatch count twice, summed over ranks, on a mesh with cp scaled for the token group where the data-parallel
    one belongs, or another factor, named). On a mesh ``W`` is the token group's size, and the cp ranks of a data
    coordinate hold the same value of each microbatch's term."""
    windows = ev.windows[window]
    d = ev.objective.auxiliary_denominator(windows)
    ratios = [float(x) * d for x in u if math.isfinite(float(x))]
    if not ratios:
        return None
    c = sum(ratios) / len(ratios)
    spread = max(abs(v - c) for v in ratios) / max(abs(c), 1e-300)
    if spread <= AUX_TOLERANCE and abs(c - 1) <= AUX_TOLERANCE:
        return None
    unit = ev.objective.auxiliary_unit
    # The main loss's factor: W on dp=W, the token group's size T = dp x cp on a mesh (windows holds one entry per
    # data coordinate, each microbatch once).
    w = ev.mesh.token_ranks
    ks = {len(rank) for rank in windows}
    n = sum(mb.supervised for rank in windows for mb in rank)
    head = f"the main loss's weights are right; the auxiliary term (unit {unit}, right weight 1/{d:g}) weighs {c:.4g}x"
    if spread > AUX_TOLERANCE:
        listed = ", ".join(f"{v:.3g}x" for v in ratios[:6])
        return au.per_microbatch(ev, window, u) or Signature(
            "auxiliary_misweighted", f"the main loss's weights are right; the auxiliary term's microbatches weigh "
            f"{listed} the right weight: not one factor (a term added on some microbatches only, or scaled by each "
            "microbatch's own count)", c)
    first, after = au.candidates(ev, window)
    named: list[au.Candidate] = list(first)
    if unit == ob.MICROBATCH and n > 0:
        # Every cp rank of a data coordinate holds the same microbatch's value: cp copies reach the average.
        words = (f"it was scaled by the main loss's token normalization (W/N = {w}/{n} on each rank) instead of "
                 "averaged over the window's microbatches (1/k on each rank: DDP's average does the rest)")
        named.append(au.Candidate(d * ev.mesh.size("cp") / n, "auxiliary_token_normalized", words, prefix=head))
    if len(ks) == 1 and next(iter(ks)) > 1:
        (k,) = ks
        named.append(au.Candidate(1 / k, "auxiliary_divided_twice", f"it was divided by the microbatch count k={k} "
                                  "twice (once in the loop, once more where it was added)", "k", head))
    named += [au.Candidate(v, name, words, "cp", head) for v, name, words in _mesh_candidates(ev)]
    if w > 1:
        sym, factor = ("W", f"W={w}") if len(ev.mesh.names) < 2 else ("T", f"the token group's size T={w}")
        named.append(au.Candidate(float(w), "auxiliary_summed_over_ranks", f"it was summed over the ranks instead of "
                                  f"averaged (multiplied by {factor} like the main loss, whose {sym} only cancels the "
                                  "gradients' average of a global normalizer)", "W", head))
    named += after
    matches = [m for m in named if abs(c / m.value - 1) <= AUX_TOLERANCE]
    if matches:
        return au.reading(ev, window, c, matches)
    factor = _aux_factor(c, w, next(iter(ks)) if len(ks) == 1 else 1)
    return Signature("auxiliary_misweighted", f"{head} the right weight: {factor}", c)


def _mesh_candidates(ev: Evidence) -> list[tuple[float, str, str]]:
    """On a mesh with cp: a per-microbatch term scaled for the token group (dp x cp) where its unit's group, the
    data-parallel one, belongs. Every cp rank of a data coordinate runs that coordinate's whole forward and holds the
    same value of its microbatches' term, so the gradients' average over dp x cp keeps cp copies of it: a factor of
    the token group's size over dp's is cp times the right weight (Megatron-LM #5047)."""
    mesh = ev.mesh
    cp = mesh.size("cp")
    if cp < 2 or ev.objective.auxiliary_unit != ob.MICROBATCH:
        return []
    token = dims_words(mesh, mesh.token_dims)
    data = dims_words(mesh, [d for d in mesh.token_dims if d != "cp"])
    many = "s" if mesh.data_ranks > 1 else ""
    words = (f"cp's size ({cp}) times the right weight; it was scaled for the token group ({token}, "
             f"{mesh.token_ranks} ranks) like the main loss, where its unit's group is {data} ({mesh.data_ranks} "
             f"rank{many}): the {cp} cp ranks of a data coordinate hold the same value of each microbatch's term, "
             f"and the gradients' average over {token} kept each of them; scale it by {data}'s size over the "
             f"microbatch count of {data} (1/k on each rank)")
    return [(float(cp), "auxiliary_misweighted", words)]


def _aux_factor(c: float, w: int, k: int) -> str:
    """An auxiliary term's factor ``c`` named as a product of W and k (the simplest first), or said to be none."""
    found = []
    for b in range(-2, 3) if w > 1 else (0,):
        for d in range(-1, 2) if k > 1 else (0,):
            value = float(w) ** b * float(k) ** d
            if (b or d) and abs(c / value - 1) <= AUX_TOLERANCE:
                found.append((abs(b) + abs(d), b, d))
    if not found:
        return "a factor no count of this window names"
    _, b, d = min(found)
    formula = "*".join(p for p, e in (("W", b), ("k", d)) if e > 0) or "1"
    under = "*".join(p for p, e in (("W", b), ("k", d)) if e < 0)
    shown = formula if not under else f"{formula}/{under}" if "*" not in under else f"{formula}/({under})"
    words = {(1, 1): ": multiplied by W like the main loss and never divided by the microbatch count k (each "
                     "microbatch's value backpropagated whole)",
             (0, 1): ": never divided by the microbatch count k"}.get((b, d), "")
    return f"a factor {shown} = {c:.4g} (W={w}, k={k}){words}"


def objective_reading(ev: Evidence, window: int, model: torch.nn.Module, sig: Signature, blocks: Sequence[Block],
                      q: Sequence[float], g: torch.Tensor, atol: float, rtol: float) -> Signature:
    """The reading once the declared objective is taken into account: another declared objective the gradient is
    exactly (it leads: "this gradient is the sequence mean"), the quantity a scaled window was divided by, or a
    normalizer per rank. ``q``: each block's fitted weight over the right one, ``1/Z``."""
    if sig.name in KEPT:
        return sig
    other = other_objective(ev, model, window, g, atol, rtol)
    if other is not None:
        if sig.name == "per_sequence_mean":  # the catalog's own name for it under the token mean stays
            return dataclasses.replace(sig, sentence=f"{sig.sentence}; {other.sentence}", objective=other.objective)
        if sig.name not in ("unexplained", "extra_term"):
            # The microbatch fit explained the weights as a catalog reading too (one row per microbatch makes a mean
            # per microbatch the sequence mean): these counts cannot tell the two apart, and the reading says so.
            return dataclasses.replace(other, alternatives=tuple(dict.fromkeys((sig.name, *sig.alternatives))))
        return other
    if ev.objective.plain:
        return sig
    if sig.name == "global_scale" and sig.factor is not None:
        return wrong_normalizer(ev, window, sig.factor) or sig
    if sig.name in ("unexplained", "mean_of_local_means", "block_scaled"):
        return per_rank_normalizer(ev, window, blocks, q) or sig
    return sig


__all__ = ["alternatives", "auxiliary_columns", "auxiliary_reading", "held", "normalizer", "objective_reading",
           "other_objective", "per_rank_normalizer", "rank_facts", "row_reading", "wrong_normalizer"]
