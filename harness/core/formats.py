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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch

HARNESS = "harness"
HF = "hf"
BATCH_FORMATS = (HARNESS, HF)
"""``--batch-format`` values."""

HF_KEYS = ("input_ids", "attention_mask", "labels")
"""The keys of an ``hf`` microbatch."""


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


def batch_as(mb: Microbatch, batch_format: str) -> Microbatch | dict[str, torch.Tensor]:
    """What a recipe receives for ``mb`` under ``batch_format``."""
    return to_hf(mb) if check_batch_format(batch_format) == HF else mb


def supervised_tokens(batch: Microbatch | Mapping[str, torch.Tensor]) -> int:
    """Supervised positions of one microbatch in either format (the same number for a microbatch and its hf dict):
    an hf dict is counted after the shift, ``labels[:, 1:]`` (its position 0 is never a target)."""
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


def hf_forward(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``model(input_ids=..., attention_mask=...)`` (labels are not passed: the loss is computed outside) -> logits."""
    return logits_of(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))


__all__ = ["BATCH_FORMATS", "HARNESS", "HF", "HF_KEYS", "batch_as", "check_batch_format", "hf_forward", "logits_of",
           "shifted_loss_sum", "supervised_tokens", "to_hf"]
