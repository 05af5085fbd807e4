"""Batch conventions: the harness's aligned :class:`Microbatch`, and the dict a Hugging Face training loop sees.

``harness`` (the default): ``Microbatch(inputs [B, T], labels [B, T])`` with labels already aligned, so ``labels[b, t]``
is the target of ``logits[b, t]`` and the loss needs no shift.

``hf``: ``{"input_ids": [B, T+1], "attention_mask": [B, T+1], "labels": [B, T+1]}`` with labels *unshifted*: the
label at position ``t`` is the token at ``t`` itself (``IGNORE_INDEX`` on the prompt and on padding), and the loss
shifts, pairing ``logits[:, :-1]`` with ``labels[:, 1:]``. The exact rule (:func:`to_hf`), for every row ``b``:

- ``input_ids[b, :T] = inputs[b]`` and ``input_ids[b, t+1] = labels[b, t]`` wherever ``labels[b, t]`` is supervised:
  the full token row, its last token included; ``PAD`` after the row's end (and at the last position of a row that
  has no supervised token, whose last token the microbatch does not hold: it is no target, and under causal
  attention it reaches no logit that predicts one);
- ``attention_mask = (input_ids != PAD)``: 1 on real tokens, 0 on padding (``PAD`` is never a real token id in the
  harness's data);
- ``labels[b, t+1] = mb.labels[b, t]`` for every ``t``: the token itself where supervised, ``IGNORE_INDEX``
  elsewhere; and ``labels[b, 0] = input_ids[b, 0]`` when the row's first target is supervised
  (``mb.labels[b, 0] != IGNORE_INDEX``: no prompt beyond its first token), ``IGNORE_INDEX`` otherwise (a row with a
  prompt, or without any supervised token). That is the ``labels = input_ids`` (prompt masked) of a real Hugging
  Face dataset: position 0 of an unprompted row holds a real token, which no logit predicts.

So the HF shift (``labels[:, 1:]``) gives exactly the harness's (position, target) pairs and the same supervised
count; a count taken before the shift (``(labels != IGNORE_INDEX).sum()``) is one too many per unprompted row, as it
is on real data (the ``hf_count_before_shift`` control).

``packed``: padding-free rows, as transformers' ``DataCollatorWithFlattening`` builds them (:func:`to_packed`):
several sequences (each the real tokens of one row's ``hf`` form) side by side in one row, ``labels`` unshifted with
``IGNORE_INDEX`` at every sequence's first position (the separator: the logit before it belongs to the previous
sequence), ``position_ids`` restarting at 0 with every sequence, ``seq_idx``, the flash-attention boundaries
``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_q``/``max_length_k``, and no ``attention_mask``. The HF shift
(``labels[:, 1:]``) gives exactly the (position, target) pairs of the sequences unpacked, and the same count, *if* the
model keeps each sequence to itself: its attention block-diagonal per sequence (a sequence starts where
``position_ids`` does not grow) and its positions read from ``position_ids`` (:func:`hf_forward` passes them).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch

HARNESS = "harness"
HF = "hf"
PACKED = "packed"
BATCH_FORMATS = (HARNESS, HF, PACKED)
"""``--batch-format`` values."""

HF_KEYS = ("input_ids", "attention_mask", "labels")
"""The keys of an ``hf`` microbatch."""

FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The flash-attention boundaries of a ``packed`` microbatch (transformers' ``FlashAttentionKwargs``)."""

PACKED_KEYS = ("input_ids", "labels", "position_ids", "seq_idx", *FLASH_KEYS)
"""The keys of a ``packed`` microbatch (and ``weights`` where the microbatch has objective weights)."""


def check_batch_format(batch_format: str, option: str = "batch_format") -> str:
    if batch_format not in BATCH_FORMATS:
        msg = f"{option}={batch_format!r} must be one of {', '.join(BATCH_FORMATS)}"
        raise ValueError(msg)
    return batch_format


def to_hf(mb: Microbatch) -> dict[str, torch.Tensor]:
    """The ``hf`` dict of a harness microbatch (see the module's docstring for the rule)."""
    b, t = mb.inputs.shape
    supervised = mb.labels != IGNORE_INDEX
    input_ids = torch.full((b, t + 1), PAD, dtype=torch.int64, device=mb.inputs.device)
    input_ids[:, :t] = mb.inputs
    input_ids[:, 1:] = torch.where(supervised, mb.labels, input_ids[:, 1:])
    labels = torch.full((b, t + 1), IGNORE_INDEX, dtype=torch.int64, device=mb.labels.device)
    labels[:, 1:] = mb.labels
    # labels = input_ids, prompt masked: a row whose first target is supervised has no prompt, and its first token
    # stands as its own label at position 0 (never a target: the shift drops it).
    if t:
        labels[:, 0] = torch.where(supervised[:, 0], input_ids[:, 0], labels[:, 0])
    out = {"input_ids": input_ids, "attention_mask": (input_ids != PAD).to(torch.int64), "labels": labels}
    if mb.weights is not None:  # the objective's per-token factors, placed like the labels (position 0 is no target)
        weights = torch.zeros((b, t + 1), dtype=mb.weights.dtype, device=mb.weights.device)
        weights[:, 1:] = mb.weights
        out["weights"] = weights
    return out


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """The packing policy: the sequences of ``lengths``, first-fit in order, into rows of at most ``capacity`` tokens
    (each sequence goes to the first row it fits in, else opens a new one). Returns each row's sequence indices."""
    if any(n > capacity for n in lengths):
        msg = f"capacity={capacity} must hold the longest sequence ({max(lengths)} tokens)"
        raise ValueError(msg)
    rows: list[list[int]] = []
    used: list[int] = []
    for i, n in enumerate(lengths):
        j = next((j for j, u in enumerate(used) if u + n <= capacity), len(rows))
        if j == len(rows):
            rows.append([])
            used.append(0)
        rows[j].append(i)
        used[j] += n
    return rows


def _layout(hf: Mapping[str, torch.Tensor], capacity: int | None) -> tuple[list[int], list[int], list[list[int]]]:
    """``(the hf rows that hold a real token, their lengths, each packed row's indices into those)``."""
    lengths = [int(n) for n in hf["attention_mask"].sum(dim=1)]
    rows_of = [b for b, n in enumerate(lengths) if n > 0]
    lengths = [lengths[b] for b in rows_of]
    longest = max(lengths, default=1)
    cap = 2 * longest if capacity is None else capacity
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < longest:
        msg = f"capacity={capacity!r} must be a whole number of tokens at least the longest sequence's ({longest})"
        raise ValueError(msg)
    return rows_of, lengths, pack_rows(lengths, cap) or [[]]  # no real token at all: one row of one padding token


def packed_layout(mb: Microbatch, capacity: int | None = None) -> list[list[int]]:
    """Which of ``mb``'s rows each row of :func:`to_packed`'s batch holds, in order (a row of ``mb`` without any real
    token is in none): the packing the diagnosis reads a packed run's weights by."""
    rows_of, _, rows = _layout(to_hf(mb), capacity)
    return [[rows_of[i] for i in row] for row in rows]


def to_packed(mb: Microbatch, capacity: int | None = None) -> dict[str, Any]:
    """The ``packed`` dict of a harness microbatch: each row of ``mb`` one sequence (the real tokens of its ``hf``
    form, :func:`to_hf`, where its ``attention_mask`` is 1; a row without any is dropped), packed by
    :func:`pack_rows` into rows of ``capacity`` tokens (default: twice the longest sequence, so that rows hold several
    sequences and their lengths and counts differ between microbatches; a microbatch of one sequence is one row).

    Each sequence's tokens in order; ``labels`` its ``hf`` labels with ``IGNORE_INDEX`` at its first position (the
    separator, as ``DataCollatorWithFlattening``'s ``separator_id``); ``position_ids`` ``0 .. n-1``; ``seq_idx`` its
    index in the packed batch (int32, counted over the rows in order); ``weights`` (where ``mb`` has them) placed like
    the labels, 0 at the separator. A row shorter than the widest is padded on the right with ``PAD`` inputs and
    ``IGNORE_INDEX`` labels, the padding cut into sequences of its own of at most the longest sequence's length
    (``position_ids`` restarting at 0, a ``seq_idx`` of their own), so that a model that keeps sequences apart keeps
    it out of every real position and no position exceeds the unpacked batch's. ``cu_seq_lens_q`` and
    ``cu_seq_lens_k`` (int32) are the sequences' boundaries over the rows flattened in order, padding pieces
    included (what transformers' ``prepare_fa_kwargs_from_position_ids`` computes from these ``position_ids``; for
    one row without padding, exactly the collator's), and ``max_length_q``/``max_length_k`` (python ints, as the
    collator's) the longest of them. Every key is always there: :func:`hf_forward` passes a model only those its
    ``forward`` takes. The count after the shift (:func:`supervised_tokens`) is ``mb.supervised``."""
    hf = to_hf(mb)
    device = mb.inputs.device
    rows_of, lengths, rows = _layout(hf, capacity)
    longest = max(lengths, default=1)
    width = max(max((sum(lengths[i] for i in row) for row in rows), default=1), 1)
    n_rows = len(rows)
    input_ids = torch.full((n_rows, width), PAD, dtype=torch.int64, device=device)
    labels = torch.full((n_rows, width), IGNORE_INDEX, dtype=torch.int64, device=device)
    position_ids = torch.zeros((n_rows, width), dtype=torch.int64, device=device)
    seq_idx = torch.zeros((n_rows, width), dtype=torch.int32, device=device)
    weights = None if mb.weights is None else torch.zeros((n_rows, width), dtype=mb.weights.dtype, device=device)
    pieces: list[int] = []  # every sequence's length over the rows in order, padding pieces included
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            b, n = rows_of[i], lengths[i]
            input_ids[r, at:at + n] = hf["input_ids"][b, :n]
            labels[r, at + 1:at + n] = hf["labels"][b, 1:n]  # at itself: the separator
            if weights is not None:
                weights[r, at + 1:at + n] = hf["weights"][b, 1:n]
            position_ids[r, at:at + n] = torch.arange(n, device=device)
            seq_idx[r, at:at + n] = len(pieces)
            pieces.append(n)
            at += n
        while at < width:  # the padding: sequences of its own, none longer than the longest real one
            n = min(width - at, longest)
            position_ids[r, at:at + n] = torch.arange(n, device=device)
            seq_idx[r, at:at + n] = len(pieces)
            pieces.append(n)
            at += n
    bounds = torch.tensor([0, *pieces], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    out: dict[str, Any] = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                           "seq_idx": seq_idx, "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
                           "max_length_q": max(pieces), "max_length_k": max(pieces)}
    if weights is not None:
        out["weights"] = weights
    return out


def batch_as(mb: Microbatch, batch_format: str) -> Microbatch | dict[str, Any]:
    """What a recipe receives for ``mb`` under ``batch_format``."""
    fmt = check_batch_format(batch_format)
    if fmt == HF:
        return to_hf(mb)
    return to_packed(mb) if fmt == PACKED else mb


def supervised_tokens(batch: Microbatch | Mapping[str, torch.Tensor]) -> int:
    """Supervised positions of one microbatch in any format (the same number for a microbatch, its hf dict and its
    packed dict): a dict is counted after the shift, ``labels[:, 1:]`` (its position 0 is never a target)."""
    if isinstance(batch, Microbatch):
        return batch.supervised
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor itself; an object with ``.logits`` (a Hugging Face ``ModelOutput``);
    or a tuple or list whose first element is the logits (``return_dict=False`` without ``labels``)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    msg = (f"the model returned {type(output).__name__}; the harness reads logits [B, T, V] from a tensor, an object "
           "with .logits, or a tuple whose first element is the logits")
    raise TypeError(msg)


def shifted_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The HF convention's loss *sum*: ``logits[:, :-1]`` against ``labels[:, 1:]``, cross-entropy summed over
    supervised positions (``IGNORE_INDEX`` ignored)."""
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        msg = f"logits must be [B, T, V] and labels [B, T]; got {tuple(logits.shape)} and {tuple(labels.shape)}"
        raise ValueError(msg)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def _forward_takes(model: torch.nn.Module) -> tuple[frozenset[str], bool]:
    """The keyword names ``model``'s own ``forward`` declares (inside a DDP wrapper or ``torch.compile``), and
    whether it takes ``**kwargs``."""
    inner = model
    while True:
        nxt = getattr(inner, "_orig_mod", None)  # torch.compile
        if nxt is None and isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            nxt = inner.module
        if not isinstance(nxt, torch.nn.Module):
            break
        inner = nxt
    try:
        params = inspect.signature(inner.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: pass nothing optional
        return frozenset(), False
    names = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def packed_kwargs(model: torch.nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The call of a ``packed`` batch: ``input_ids`` and ``position_ids``, no ``attention_mask`` (a mask of ones
    would make transformers' models attend across the sequences: docs/your-model.md); the flash-attention boundaries
    (:data:`FLASH_KEYS`) and ``use_cache=False`` (transformers builds the block-diagonal mask only without a cache)
    only where the model's ``forward`` names them or takes ``**kwargs`` (``use_cache`` only where named): a model
    that does not take them would raise on them."""
    names, var_kw = _forward_takes(model)
    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    kwargs.update({k: batch[k] for k in FLASH_KEYS if k in batch and (var_kw or k in names)})
    if "use_cache" in names:
        kwargs["use_cache"] = False
    return kwargs


def hf_forward(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """A dict batch's model call -> logits (labels are not passed: the loss is computed outside). An ``hf`` batch:
    ``model(input_ids=..., attention_mask=...)``; a ``packed`` one (``position_ids`` and no ``attention_mask``):
    :func:`packed_kwargs`."""
    if "attention_mask" not in batch and "position_ids" in batch:
        return logits_of(model(**packed_kwargs(model, batch)))
    return logits_of(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))


__all__ = ["BATCH_FORMATS", "FLASH_KEYS", "HARNESS", "HF", "HF_KEYS", "PACKED", "PACKED_KEYS", "batch_as",
           "check_batch_format", "hf_forward", "logits_of", "pack_rows", "packed_kwargs", "packed_layout",
           "shifted_loss_sum", "supervised_tokens", "to_hf", "to_packed"]
