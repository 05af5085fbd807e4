"""The diagnosis's readings of a packed run (``--batch-format=packed``), from the packing itself: which sequences
share a packed row (:func:`harness.core.formats.packed_layout`, deterministic from the microbatch).

Two mistakes only the packing explains:

- ``shifted_across_boundaries``: labels rebuilt over the whole packed row without the collator's separator, so
  each sequence's last token is also trained to predict the first token of the next sequence in its row. No
  re-weighting of the sequences' losses makes that term; the boundary pairs' loss gradient of each microbatch
  (:func:`boundary_columns`) is fitted beside the blocks' (:func:`fit_beside`), and the gradient is named when that
  joint fit explains it, the blocks read right, and the boundary pairs weigh like every supervised token.
- ``per_pack_mean``: a mean per packed row taken for a mean per sequence, read on the per-sequence fit by the packs
  each row lies in (:func:`harness.diagnosis.row_weights.read_packs`).

``tests/unit/test_packed_diagnosis.py`` checks the pairs against :func:`harness.core.formats.to_packed` and the
arithmetic; ``tests/distributed/test_negative_controls.py`` reads each control.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from harness.core import objectives as ob
from harness.core.compare import flat_grad
from harness.core.formats import PACKED, packed_layout, to_hf
from harness.core.microbatch import Microbatch
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.fit import MATCH_TOLERANCE, MAX_CONDITION, Block, Fit, explained_residual, fit_weights
from harness.diagnosis.row_weights import read_packs
from harness.diagnosis.signatures import Signature, classify


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


def boundary_reading(ev: Evidence, model: torch.nn.Module, window: int, a: torch.Tensor, g: torch.Tensor,
                     blocks: Sequence[Block], mbs: Sequence[Microbatch], rank: int,
                     others: Mapping[str, int]) -> tuple[Fit, Signature] | None:
    """``(the blocks' fit, shifted_across_boundaries)`` when ``g`` is the right weighting of the blocks plus the
    boundary pairs' loss at one common weight (a packed run under the token mean); None otherwise."""
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
    if sig.name not in ("correct", "float32_computation"):
        return None
    n = sum(b.tokens for b in blocks)
    pairs = sum(len(boundary_pairs(mb)) for mb in mbs)
    words = boundary_sentence([float(w) * n for w in u], pairs, n)
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


__all__ = ["boundary_columns", "boundary_loss", "boundary_pairs", "boundary_reading", "boundary_sentence",
           "fit_beside", "pack_reading", "packs_of"]
