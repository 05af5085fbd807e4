"""Negative controls, packed family. The packed batch format (``--batch-format=packed``: several sequences per row,
as transformers' ``DataCollatorWithFlattening`` builds them, :func:`harness.core.formats.to_packed`): a count taken
from the rows' tokens, labels rebuilt across the sequences' boundaries (for the loss, the count, or both), a
sequence mean over the rows.

Each class declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.core.formats import PACKED, hf_forward
from harness.core.loss import check_global_count, global_count
from harness.core.microbatch import IGNORE_INDEX, PAD
from harness.recipes.catalog import Target, control
from harness.recipes.correct import _sync_last, _world_size, global_sum, window_count
from harness.recipes.objectives import SequenceMean


def _packed_window(model: nn.Module, window: Sequence[Mapping[str, Any]], total: int,
                   labels_of: Any = None) -> float:
    """The correct packed loop (sums, ``no_sync``, the shift once in the loss, every rank's loss sum times
    ``W / total``) with the count ``total`` given, and the labels ``labels_of(batch)`` (default: the batch's own)."""
    world, local = _world_size(), 0.0
    for i, batch in enumerate(window):
        labels = batch["labels"] if labels_of is None else labels_of(batch)
        with _sync_last(model, i, len(window)):
            logits = hf_forward(model, batch)  # input_ids and position_ids, no attention_mask
            s = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
            (s * (world / total)).backward()
        local += float(s.detach())
    return global_sum(local) / total


@control(Target("parity", "uneven", batch_format=PACKED), "global_scale")
class PackedCountFromRowLength:
    """The correct packed loop whose count is the packed rows' real tokens, ``(input_ids != pad).sum()``: what an
    attention mask's sum or the rows' lengths give, and what a loop written for padded batches counts when it
    normalizes by ``attention_mask.sum()``. The collator's separator makes each sequence's first position no
    target (``labels`` is -100 there), and a prompt is no target either, so the count is one too many per sequence
    (more with a prompt), and every weight is ``N / (N + sequences + prompt tokens)``: a global scale."""

    name = "packed_count_from_row_length"

    def backward_window(self, model: nn.Module, window: Sequence[Mapping[str, Any]]) -> float | None:
        window_count(window)  # every rank refuses a window without a supervised token, together
        total = global_count(sum(int((batch["input_ids"] != PAD).sum()) for batch in window))  # the mistake
        check_global_count(total)
        return _packed_window(model, window, total)


def _across_boundaries(batch: Mapping[str, Any]) -> torch.Tensor:
    """The batch's labels with every separator dropped: at each sequence's first position (``position_ids`` 0,
    past the row's first) the token itself, so the shift pairs the previous sequence's last token with it."""
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    start = (pos == 0) & (ids != PAD)
    start[:, 0] = False  # a row's first position is no target of any logit
    return torch.where(start, ids, labels)


@control(Target("parity", "uneven", batch_format=PACKED), "shifted_across_boundaries")
class PackedLabelsShiftedAcrossBoundaries:
    """The labels rebuilt over the whole packed row as if it were one sequence: ``labels = input_ids`` (prompts kept
    masked) without the collator's separator, so the shift trains the last token of every sequence to predict the
    first token of the next sequence in its row, a pair that no unpacked sequence holds. The count is the batch's own
    (the Trainer's ``num_items_in_batch``, taken from the collator's labels before a custom ``compute_loss`` rebuilt
    them), so every real pair weighs right and the gradient holds one extra term: the boundary pairs' loss."""

    name = "packed_labels_shifted_across_boundaries"

    def backward_window(self, model: nn.Module, window: Sequence[Mapping[str, Any]]) -> float | None:
        total = window_count(window)
        return _packed_window(model, window, total, _across_boundaries)


def _rebuilt_count(window: Sequence[Mapping[str, Any]]) -> int:
    """The all-reduced count of the labels rebuilt over the whole packed row (:func:`_across_boundaries`), after the
    shift: the window's supervised tokens and, in every packed row, each sequence's first position past the row's
    first (a separator the batch's labels mark -100)."""
    return global_count(sum(int((_across_boundaries(batch)[:, 1:] != IGNORE_INDEX).sum()) for batch in window))


@control(Target("parity", "uneven", batch_format=PACKED), "counted_across_boundaries")
class PackedCountAcrossBoundaries:
    """The correct packed loss (the batch's labels, the separator kept) over the count of the labels rebuilt over
    the whole packed row as if it were one sequence (``labels = input_ids``, prompts masked, only the row's first
    position no target): a count taken by a data step that builds its own labels before the packing collator places
    its separators, as a ``num_items_in_batch`` from those labels is. Each boundary inside a packed row is counted
    as a target the loss never sees, so every weight is ``N / (N + B)``, B the sequences that start past their
    row's first position."""

    name = "packed_count_across_boundaries"

    def backward_window(self, model: nn.Module, window: Sequence[Mapping[str, Any]]) -> float | None:
        window_count(window)  # every rank refuses a window without a supervised token, together
        total = _rebuilt_count(window)  # the mistake: the boundaries counted
        check_global_count(total)
        return _packed_window(model, window, total)


@control(Target("parity", "uneven", batch_format=PACKED), "shifted_and_counted_across_boundaries")
class PackedLabelsRebuiltAndCounted:
    """The labels rebuilt over the whole packed row (:func:`_across_boundaries`: the separator dropped, prompts kept
    masked), as ``packed_labels_shifted_across_boundaries`` does, and the loss divided by the count of those rebuilt
    labels, as a loop that builds its labels and its count in one place (``shift_labels = labels[:, 1:]``;
    ``(shift_labels != -100).sum()``) does: the boundary pairs are supervised *and* counted, so every supervised
    token and every boundary pair weighs ``1/(N + B)``."""

    name = "packed_labels_rebuilt_and_counted"

    def backward_window(self, model: nn.Module, window: Sequence[Mapping[str, Any]]) -> float | None:
        window_count(window)
        total = _rebuilt_count(window)  # the mistake: the rebuilt labels' own count
        check_global_count(total)
        return _packed_window(model, window, total, _across_boundaries)


def _supervised_rows(window: Sequence[Mapping[str, Any]]) -> int:
    return sum(int(((batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1) > 0).sum()) for batch in window)


@control(Target("parity", "uneven", batch_format=PACKED, objective="sequence_mean"), "per_pack_mean")
class PackedSequenceMeanOverRows(SequenceMean):
    """A sequence mean written for padded batches, run on packed rows: each *row's* mean (``loss.sum(dim=1) /
    mask.sum(dim=1)``), over the global count of rows with a supervised token. A packed row holds several
    sequences, so the mean runs over packs: every token of pack ``r`` weighs ``1/(n_r P)``, with ``n_r`` the pack's
    supervised tokens and ``P`` the packs, where the sequence mean gives ``1/(n_s S)``."""

    name = "packed_sequence_mean_over_rows"

    def term_of(self, mb: Any, ce: torch.Tensor, mask: torch.Tensor,
                weights: torch.Tensor | None) -> torch.Tensor:
        return self.term(ce, mask, weights)  # the mistake: the rows taken for the sequences

    def divisor(self, window: Sequence[Any]) -> float:
        return float(global_count(_supervised_rows(window)))

