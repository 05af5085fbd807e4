"""An auxiliary term's weight read by the fact of the window its unit makes it depend on: the microbatch count k of a
per-microbatch term, the data group's size of a global one, each microbatch's micro-batch size B of a per-sequence
one, the token total N of a per-token one, and tp's size for a per-token or global term scaled by one sequence
shard's token count (docs/objectives.md, "Router auxiliary terms").

:func:`harness.diagnosis.objective.auxiliary_reading` fits the term's columns (one per microbatch) beside the main
loss's blocks and divides each fitted weight by its unit's ``1/D``; a ratio ``c`` common to every microbatch is
matched here against the facts each unit's public mistakes are off by, and a ratio that varies by microbatch against
each microbatch's own rows. Where two facts are equal in this window (k = W = 2), the reading names both and the
window that tells them apart (:meth:`harness.diagnosis.axes.Axes.apart`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.core import objectives as ob
from harness.diagnosis.axes import axes_of
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.signatures import Signature

AUX_TOLERANCE = 1e-3
"""Largest relative deviation of a fitted ratio from a named fact (the columns are fitted beside the main blocks', a
little less accurately): :data:`harness.diagnosis.objective.AUX_TOLERANCE`."""


@dataclass(frozen=True)
class Candidate:
    """A named fact a common ratio may equal."""

    value: float
    name: str
    words: str
    symbol: str | None = None
    """The fact's symbol among the layout's (:meth:`harness.diagnosis.axes.Axes.sizes`: ``k``, ``W``, ``dp``, ...),
    where it is one: two candidates equal here are told apart by it."""
    prefix: str | None = None
    """What the sentence starts with when this candidate leads (None: :func:`head_words`, the unit named)."""


UNIT_WORDS = {
    ob.MICROBATCH: "one value per microbatch, averaged over the window's microbatches",
    ob.TOKEN: "a sum over supervised tokens, over the window's supervised count N",
    ob.SEQUENCE: "a sum of per-sequence values, over S, the window's sequences with a supervised token",
    ob.GLOBAL: "the router statistics of the whole window, over N",
}


def _data_symbol(ev: Evidence) -> str:
    """The data group's symbol in the layout's facts (``W`` at dp=W, ``dp`` beside cp, ``D`` over two dims)."""
    dims = axes_of(ev, 0, 0).dims_of()
    data = frozenset(d for d in ev.mesh.names if d in ("dp", "dp_replicate", "dp_shard") and ev.mesh.size(d) > 1)
    return next((sym for sym, group in dims.items() if group == data), "D")


def candidates(ev: Evidence, window: int) -> tuple[list[Candidate], list[Candidate]]:
    """The unit's own facts: those read before the catalog's older auxiliary readings, and those after (a
    per-microbatch term's k comes after them, so that a summed-over-ranks term at k = W keeps its reading)."""
    windows = ev.windows[window]
    unit = ev.objective.auxiliary_unit
    ks = {len(rank) for rank in windows}
    k = next(iter(ks)) if len(ks) == 1 else None
    n = sum(mb.supervised for rank in windows for mb in rank)
    dp = ev.mesh.data_ranks
    rows = {int(mb.inputs.shape[0]) for rank in windows for mb in rank if mb.supervised}
    first: list[Candidate] = []
    after: list[Candidate] = []
    if unit == ob.MICROBATCH and k is not None and k > 1:
        after.append(Candidate(float(k), "auxiliary_not_divided_by_k", f"k={k} times its unit's weight: added whole to "
                               f"every microbatch's loss and never divided by the accumulation steps k={k} (each rank "
                               "adds aux, not aux / k)", "k"))
    if unit == ob.GLOBAL and dp > 1:
        first.append(Candidate(1 / dp, "auxiliary_divided_by_dp", f"1/dp = 1/{dp} of its unit's weight: each rank "
                               f"backpropagated its share of the window's term (its tokens' probabilities against the "
                               f"window's assignment fractions, over the global N) without the data group's size "
                               f"dp={dp} that the gradients' average divides every rank's share by, so the term was "
                               "averaged over the data ranks", _data_symbol(ev)))
    if unit in (ob.TOKEN, ob.GLOBAL) and n > 1:
        first.append(Candidate(float(n), "auxiliary_not_divided_by_tokens", f"N={n} times its unit's weight: its "
                               f"per-token sum was never divided by the window's supervised count N={n} (multiplied by "
                               "the main loss's world-size factor, whose division by N never came)"))
    tp = ev.mesh.size("tp")
    if unit in (ob.TOKEN, ob.GLOBAL) and tp > 1:
        first.append(Candidate(1 / tp, "auxiliary_divided_by_tp", f"1/tp = 1/{tp} of its unit's weight: it was "
                               f"scaled by the router's local token count, the tokens of one tp rank's sequence shard "
                               f"(1/{tp} of the microbatch's under sequence parallelism), where the microbatch's whole "
                               f"count belongs (Megatron-LM's num_local_tokens under per-token loss); multiply its "
                               f"scale by tp={tp}, the size of the group the sequence is sharded over", "tp"))
    if unit == ob.SEQUENCE and len(rows) == 1 and next(iter(rows)) > 1:
        (b,) = rows
        first.append(Candidate(1 / b, "auxiliary_divided_by_micro_batch_size", _b_words(f"{b} rows in every one")))
    return first, after


def _b_words(b: str) -> str:
    return (f"1/B of its unit's weight in each microbatch, B its micro-batch size ({b}): each microbatch's "
            "per-sequence values were averaged over its B rows where their sum belongs (a sequence-level term scaled "
            "by the sequence length instead of length x micro-batch size), so every sequence weighs 1/(B x S)")


def per_microbatch(ev: Evidence, window: int, u: torch.Tensor) -> Signature | None:
    """A ratio that varies by microbatch, read against each microbatch's own rows: ``ratio_m x B_m = 1`` on every
    microbatch is a per-sequence term divided by its micro-batch size (None: no such fact)."""
    if ev.objective.auxiliary_unit != ob.SEQUENCE:
        return None
    d = ev.objective.auxiliary_denominator(ev.windows[window])
    held = [mb for rank in ev.windows[window] for mb in rank]
    pairs = [(float(x) * d, mb) for x, mb in zip(u, held) if math.isfinite(float(x))]
    facts = (("its rows", lambda mb: float(mb.inputs.shape[0])),
             ("its rows with a supervised token", lambda mb: ob.share(ob.SEQUENCE_MEAN, mb)))
    for what, fact in facts:
        values = [fact(mb) for _, mb in pairs]
        if pairs and all(v > 0 and abs(r * v - 1) <= AUX_TOLERANCE for (r, _), v in zip(pairs, values)):
            listed = ", ".join(f"{v:g}" for v in values[:6])
            words = _b_words(f"{what}: {listed}{', ...' if len(values) > 6 else ''}")
            head = head_words(ev, d)
            return Signature("auxiliary_divided_by_micro_batch_size", f"{head} {words}", None)
    return None


def head_words(ev: Evidence, d: float) -> str:
    unit = ev.objective.auxiliary_unit or ""
    return (f"the main loss's weights are right; the auxiliary term (unit {unit}: {UNIT_WORDS.get(unit, unit)}, "
            f"right weight 1/{d:g}) weighs")


def reading(ev: Evidence, window: int, c: float, matches: Sequence[Candidate]) -> Signature:
    """The first matching candidate, with the others as the readings these counts cannot tell from it, and where
    their facts differ."""
    lead, rest = matches[0], matches[1:]
    d = ev.objective.auxiliary_denominator(ev.windows[window])
    sentence = f"{head_words(ev, d)} {lead.words}" if lead.prefix is None else f"{lead.prefix}: {lead.words}"
    others = [m for m in rest if m.name != lead.name]
    if others:
        sentence += "; the same factor also reads " + "; or ".join(m.words for m in others)
        axes = axes_of(ev, window, 0)
        where = [axes.apart(lead.symbol, m.symbol) for m in others if lead.symbol and m.symbol]
        told = next((w for w in where if w), None)
        if told:
            sentence += f" ({told} tells them apart)"
    return Signature(lead.name, sentence, c, alternatives=tuple(dict.fromkeys(m.name for m in others)))


__all__ = ["AUX_TOLERANCE", "UNIT_WORDS", "Candidate", "candidates", "head_words", "per_microbatch", "reading"]
