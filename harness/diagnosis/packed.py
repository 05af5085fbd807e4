"""The diagnosis's readings of a packed run (``--batch-format=packed``), from the packing itself: which sequences
share a packed row (:func:`harness.core.formats.packed_layout`, deterministic from the microbatch).

Two mistakes only the packing explains:

- ``shifted_across_boundaries``: labels rebuilt over the whole packed row without the collator's separator, so
  each sequence's last token is also trained to predict the first token of the next sequence in its row. No
  re-weighting of the sequences' losses makes that term; the boundary pairs' loss gradient of each microbatch
  (:func:`boundary_columns`) is fitted beside the blocks' (:func:`fit_beside`), and the gradient is named when that
  joint fit explains it, the blocks read right, and the boundary pairs weigh like every supervised token.
- ``shifted_and_counted_across_boundaries``: the same rebuilt labels, and the loss divided by their own count:
  the blocks and the boundary pairs fitted together all weigh ``1/(N + B)``, B the window's boundaries inside its
  packed rows (:func:`count_facts`).
- ``counted_across_boundaries``: the batch's own loss divided by a count of the packed rows' positions that takes
  each boundary for a target: a common scale ``N / (N + B)``, or ``N / (N + P + B)`` with the prompt positions
  (``(input_ids[:, 1:] != pad).sum()``), read off the window's own counts (:func:`count_reading`).
- ``per_pack_mean``: a mean per packed row taken for a mean per sequence, read on the per-sequence fit by the packs
  each row lies in (:func:`harness.diagnosis.row_weights.read_packs`).

``tests/unit/test_packed_diagnosis.py`` checks the pairs against :func:`harness.core.formats.to_packed` and the
arithmetic; ``tests/distributed/test_negative_controls.py`` reads each control.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.core import objectives as ob
from harness.core.compare import flat_grad
from harness.core.formats import PACKED, packed_layout, to_hf, to_packed
from harness.core.microbatch import PAD, Microbatch
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.factor_names import close
from harness.diagnosis.fit import (
    MATCH_TOLERANCE,
    MAX_CONDITION,
    Block,
    Fit,
    explained_residual,
    fit_weights,
    match_tolerance,
)
from harness.diagnosis.row_weights import read_packs
from harness.diagnosis.signatures import Signature, classify, scale_tolerance


def boundary_pairs(mb: Microbatch) -> list[tuple[int, int, int]]:
    """The pairs across the sequences' boundaries in ``mb``'s packed rows: ``(row, position, token)``, the logit at
    ``position`` of ``mb``'s hf row ``row`` (its last real token) and the first token of the sequence after it in the
    same packed row."""
    hf = to_hf(mb)
    lengths = hf["attention_mask"].sum(dim=1)
    out = []
    for pack in packed_layout(mb):
        for b, nxt in itertools.pairwise(pack):
            out.append((b, int(lengths[b]) - 1, int(hf["input_ids"][nxt, 0])))
    return out


def boundary_loss(ev: Evidence, model: torch.nn.Module, mb: Microbatch) -> torch.Tensor | None:
    """The cross-entropy sum of ``mb``'s boundary pairs through the run's model (the unpacked hf call, whose logit at a
    sequence's last token is the packed one's where the model keeps sequences apart); None without a pair."""
    pairs = boundary_pairs(mb)
    if not pairs:
        return None
    raw, _ = ev.model.logits(model, mb)
    rows, at, targets = (torch.tensor(c, dtype=torch.int64) for c in zip(*pairs))
    return F.cross_entropy(raw[rows, at], targets.to(raw.device), reduction="sum")


def boundary_columns(ev: Evidence, model: torch.nn.Module, mbs: Sequence[Microbatch]) -> torch.Tensor | None:
    """``[components, blocks]``: each microbatch's gradient of its boundary pairs' loss (zero without a pair); None
    where no microbatch has a pair."""
    cols, size = [], sum(p.numel() for p in model.parameters())
    for mb in mbs:
        model.zero_grad(set_to_none=True)
        loss = boundary_loss(ev, model, mb)
        if loss is None:
            cols.append(torch.zeros(size, dtype=torch.float64))
            continue
        loss.backward()
        cols.append(flat_grad(model).double())
    stacked = torch.stack(cols, dim=1)
    return None if not bool(stacked.any()) else stacked


def fit_beside(a: torch.Tensor, g: torch.Tensor, extra: torch.Tensor) -> tuple[Fit, torch.Tensor, Fit]:
    """The blocks ``a`` and ``extra`` columns fitted together to ``g``: ``(the blocks' part, as a fit of its own
    with the joint residual; the extra columns' weights; the joint fit)``."""
    joint = fit_weights(torch.cat([a, extra], dim=1), g)
    k = a.shape[1]
    return Fit(joint.weights[:k], joint.residual, joint.condition), joint.weights[k:], joint


def boundary_sentence(ratios: Sequence[float], pairs: int, n: int) -> str | None:
    """The words for boundary columns fitted at ``ratios`` (each microbatch's weight over ``1/N``): None unless they
    share one value."""
    live = [r for r in ratios if math.isfinite(r)]
    if not live:
        return None
    c = sum(live) / len(live)
    if c <= 0 or max(abs(r / c - 1) for r in live) > MATCH_TOLERANCE:
        return None
    scale = ("like every supervised token (1/N)" if abs(c - 1) <= MATCH_TOLERANCE else
             f"{c:.4g}x a supervised token's 1/N")
    return (f"the weights are right, and the gradient also holds the loss of the {pairs} pairs across the packed "
            f"sequences' boundaries (N={n}), each weighing {scale}: every sequence's last token is trained to predict "
            "the first token of the next sequence in its row, as labels rebuilt over the whole packed row without the "
            "collator's separator give; keep the batch's labels (-100 at each sequence's first position)")


@dataclass(frozen=True)
class CountFacts:
    """The window's counts a packed recipe may divide by when it takes the packed rows' positions for its targets
    (every rank's microbatches): N, the B boundaries inside the packed rows (a sequence that starts past its row's
    first position: its first position is the separator, -100 in the batch's labels, and the pair before it is a
    boundary pair, :func:`boundary_pairs`), and the positions after the shift that are not padding, N + P + B with
    P the prompt positions."""

    n: int
    boundaries: int
    positions: int

    @property
    def prompts(self) -> int:
        return self.positions - self.n - self.boundaries

    def counts(self) -> list[tuple[int, str, str]]:
        """``(X, its formula, what it counts)``: N + B, and N + P + B where the window holds a prompt position."""
        b = self.boundaries
        out = [(self.n + b, "N + B", f"the supervised tokens and the B={b} boundaries inside the packed rows (each "
                "sequence's first position past its row's first, the separator the batch's labels mark -100) taken "
                "for targets, as the labels rebuilt over the whole packed row count them")]
        if self.prompts > 0:
            out.append((self.positions, "N + P + B", f"the packed rows' positions after the shift that are not "
                        f"padding ((input_ids[:, 1:] != pad).sum()), which take the P={self.prompts} prompt "
                        f"positions and the B={b} boundaries inside the rows for targets"))
        return out


def count_facts(mbs: Sequence[Microbatch]) -> CountFacts:
    """:class:`CountFacts` of a window's microbatches (every rank's), from their own packing."""
    return CountFacts(n=sum(mb.supervised for mb in mbs), boundaries=sum(len(boundary_pairs(mb)) for mb in mbs),
                      positions=sum(int((to_packed(mb)["input_ids"][:, 1:] != PAD).sum()) for mb in mbs))


def named_count(facts: CountFacts, c: float, tolerance: float) -> tuple[int, str, str] | None:
    """The count X of ``facts`` with ``c = N / X`` within ``tolerance``, where one token more or less in X would
    not also match (None otherwise)."""
    for x, formula, words in facts.counts():
        if facts.boundaries and tolerance < 1 / (2 * x) and close(c, facts.n / x, tolerance):
            return x, formula, words
    return None


def count_reading(ev: Evidence, window: int, fit: Fit, sig: Signature) -> Signature | None:
    """``counted_across_boundaries`` when a packed run's ``global_scale`` (under the token mean) is ``N / X`` for a
    count X that takes the boundaries inside the packed rows for targets (:meth:`CountFacts.counts`); None
    otherwise. ``fit``: the microbatch fit, its weights read as ratios ``w * N``."""
    if ev.batch_format != PACKED or not ev.objective.plain or sig.name != "global_scale" or sig.factor is None:
        return None
    facts = count_facts([mb for rank in ev.windows[window] for mb in rank])
    q = [float(w) * facts.n for w in fit.weights]
    named = named_count(facts, sig.factor, scale_tolerance(q, sig.factor, fit, ev.precision))
    if named is None:
        return None
    x, formula, words = named
    return Signature("counted_across_boundaries", f"every token weighs 1/({formula}) = 1/{x} where 1/N is right "
                     f"(N={facts.n}): the loss was divided by {words}; the loss itself is the batch's (no boundary "
                     "pair is in the gradient)", sig.factor)


def _counted_pairs(facts: CountFacts, ratios: Sequence[float], c: float, tolerance: float) -> Signature | None:
    """``shifted_and_counted_across_boundaries`` when the boundary columns' ``ratios`` (each microbatch's weight over
    ``1/N``) are the blocks' common ``c`` and ``c = N / X`` for a count of :meth:`CountFacts.counts`."""
    live = [r for r in ratios if math.isfinite(r)]
    if not live or max(abs(r / c - 1) for r in live) > match_tolerance():
        return None
    named = named_count(facts, c, tolerance)
    if named is None:
        return None
    x, formula, words = named
    divided = "their own count, N + B" if formula == "N + B" else words
    return Signature("shifted_and_counted_across_boundaries", f"the gradient holds the loss of the "
                     f"B={facts.boundaries} pairs across the packed sequences' boundaries beside the {facts.n} "
                     f"supervised tokens, and every one of them weighs 1/({formula}) = 1/{x} where 1/N is right "
                     f"(N={facts.n}): labels rebuilt over the whole packed row, the separator dropped, train every "
                     "sequence's last token to predict the first token of the next sequence in its row, and the loss "
                     f"was divided by {divided}", c)


def boundary_reading(ev: Evidence, model: torch.nn.Module, window: int, a: torch.Tensor, g: torch.Tensor,
                     blocks: Sequence[Block], mbs: Sequence[Microbatch], rank: int,
                     others: Mapping[str, int]) -> tuple[Fit, Signature] | None:
    """``(the blocks' fit, shifted_across_boundaries)`` when ``g`` is the right weighting of the blocks plus the
    boundary pairs' loss at one common weight, ``shifted_and_counted_across_boundaries`` when that common weight is
    ``1/(N + B)``, the rebuilt labels' count (a packed run under the token mean); None otherwise."""
    if ev.batch_format != PACKED or not ev.objective.plain:
        return None
    extra = boundary_columns(ev, model, mbs)
    if extra is None:
        return None
    fit, u, joint = fit_beside(a, g, extra)
    if joint.residual > explained_residual() or not joint.condition <= MAX_CONDITION:
        return None
    sig = classify(blocks, fit, ev.mesh.token_ranks, ev.precision, rank=ev.mesh.token_rank(rank),
                   other_counts=others)
    n = sum(b.tokens for b in blocks)
    ratios = [float(w) * n for w in u]
    if sig.name == "global_scale" and sig.factor is not None:
        q = [float(w) * n for w in fit.weights]
        tol = scale_tolerance(q, sig.factor, fit, ev.precision)
        counted = _counted_pairs(count_facts(mbs), ratios, sig.factor, tol)
        return None if counted is None else (fit, counted)
    if sig.name not in ("correct", "float32_computation"):
        return None
    pairs = sum(len(boundary_pairs(mb)) for mb in mbs)
    words = boundary_sentence(ratios, pairs, n)
    return None if words is None else (fit, Signature("shifted_across_boundaries", words, 1.0))


def packs_of(ev: Evidence, window: int, rows: Sequence[Block]) -> list[int]:
    """Each row's packed row, numbered over the window (rows of the per-sequence view: ``rank``, ``microbatch``,
    ``row``)."""
    ids: dict[tuple[int, int, int], int] = {}
    for r, mbs in enumerate(ev.windows[window]):
        for m, mb in enumerate(mbs):
            for pack in packed_layout(mb):
                number = len({v for v in ids.values()})
                for b in pack:
                    ids[(r, m, b)] = number
    return [ids.get((b.rank, b.microbatch, b.row if b.row is not None else -1), -1) for b in rows]


def pack_reading(ev: Evidence, window: int, rows: Sequence[Block], fit: Fit) -> Signature | None:
    """``per_pack_mean`` on the per-sequence fit of a packed run (each row's weight turned into its tokens' weight
    as :func:`harness.diagnosis.objective.row_reading` does); None elsewhere."""
    if ev.batch_format != PACKED or fit.residual > explained_residual():
        return None
    per_token = [float(u) / (b.tokens if ev.objective.name == ob.SEQUENCE_MEAN and b.tokens else 1)
                 for b, u in zip(rows, fit.weights)]
    declared = f"{ev.objective.name} is {ev.objective.describe()}"
    return read_packs(rows, per_token, packs_of(ev, window, rows), fit.residual, declared)


__all__ = ["CountFacts", "boundary_columns", "boundary_loss", "boundary_pairs", "boundary_reading",
           "boundary_sentence", "count_facts", "count_reading", "fit_beside", "named_count", "pack_reading",
           "packs_of"]
