"""Negative controls, hf family. The hf batch format (``--batch-format=hf``: dicts with unshifted labels, the shift
in the loss): shifting twice, not at all, or counting tokens before the shift.

Each class declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from harness.core.formats import HF, logits_of
from harness.core.loss import check_global_count, global_count
from harness.core.microbatch import IGNORE_INDEX
from harness.recipes.catalog import Target, control
from harness.recipes.correct import _sync_last, _world_size, global_sum, window_count


def _hf_window(model: nn.Module, window: Sequence[dict[str, torch.Tensor]],
               pairs: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The correct hf recipe (the right global count, sums, ``no_sync``) except for how it pairs logits with labels:
    ``pairs(logits, labels)`` returns the two aligned tensors the loss compares."""
    total = window_count(window)
    world, local = _world_size(), 0.0
    for i, batch in enumerate(window):
        with _sync_last(model, i, len(window)):
            logits = logits_of(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
            lg, lb = pairs(logits, batch["labels"])
            s = F.cross_entropy(lg.flatten(0, 1), lb.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            (s * (world / total)).backward()
        local += float(s.detach())
    return global_sum(local) / total


@control(Target("parity", "uneven", batch_format=HF), "unexplained")
class HfShiftTwice:
    """Shifts labels that the loss shifts again: the batch's labels are moved one step left "to align them" (as if
    they were the harness's pre-shifted labels), then the HF loss pairs ``logits[:, :-1]`` with ``labels[:, 1:]``, so
    every position is trained on the token two ahead. A loss that runs, decreases and optimizes another objective."""

    name = "hf_shift_twice"

    def backward_window(self, model: nn.Module, window: Sequence[dict[str, torch.Tensor]]) -> float | None:
        def twice(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            once = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
            return logits[:, :-1], once[:, 1:]

        return _hf_window(model, window, twice)


@control(Target("parity", "uneven", batch_format=HF), "unexplained")
class HfNoShift:
    """Takes the unshifted labels as aligned: ``logits[:, t]`` against ``labels[:, t]``, the token at ``t`` itself,
    which position ``t`` already sees (the harness's aligned labels used in the hf convention)."""

    name = "hf_no_shift"

    def backward_window(self, model: nn.Module, window: Sequence[dict[str, torch.Tensor]]) -> float | None:
        return _hf_window(model, window, lambda logits, labels: (logits, labels))


@control(Target("parity", "uneven", batch_format=HF), "global_scale")
class HfCountBeforeShift:
    """The correct hf loop (sums, ``no_sync``, the shift once in the loss) whose count is taken *before* the shift:
    ``(labels != -100).sum()`` over the unshifted labels, as transformers' ``Trainer._get_num_items_in_batch``
    counted its ``num_items_in_batch`` for causal LM losses (fixed in huggingface/transformers#46204). Position 0 of
    a row without a prompt holds a real token (``labels = input_ids``) that the shift never makes a target, so the
    count is one too many per such row, and every weight is ``N / (N + rows without a prompt)``: a global scale that
    a loss curve never shows."""

    name = "hf_count_before_shift"

    def backward_window(self, model: nn.Module, window: Sequence[dict[str, torch.Tensor]]) -> float | None:
        local_count = sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in window)  # the mistake
        total = global_count(local_count)
        check_global_count(total)
        world, local = _world_size(), 0.0
        for i, batch in enumerate(window):
            with _sync_last(model, i, len(window)):
                logits = logits_of(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
                s = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
                (s * (world / total)).backward()
            local += float(s.detach())
        return global_sum(local) / total
