"""transformers' causal-LM loss under data parallelism, the way its ``Trainer`` normalizes it.

Tested with transformers 5.24.0 (torch 2.13.0). The loss is ``transformers.loss.loss_utils.ForCausalLMLoss``, the
function every ``*ForCausalLM`` model calls when given ``labels``. The harness's labels are already aligned, so the
recipes pass them as ``shift_labels=`` (passed as ``labels=`` alone they would be shifted a second time). With
``num_items_in_batch`` the loss is a sum divided by that number; the loop is the ``Trainer``'s inner loop: one
``compute_loss`` and backward per microbatch, ``no_sync()`` around all but the window's last one, the logged loss the
mean over ranks of each rank's summed step losses (``Trainer._nested_gather(tr_loss).mean()``).

- ``transformers_global_items``: ``TrainingArguments(average_tokens_across_devices=True)``, the default in 5.x.
  ``num_items_in_batch`` is the window's supervised count gathered over every rank, and ``compute_loss`` multiplies
  the loss by the number of processes, which undoes DDP's average: the global token mean.
- ``transformers_local_items``: ``average_tokens_across_devices=False``. ``num_items_in_batch`` is this rank's count
  and there is no factor, so DDP averages each rank's local token mean: the mean of local means.

- ``transformers_global_items_hf``: the same global-items step on a transformers model with the ``hf`` batch format
  (``--model`` and ``--batch-format hf``): the model computes its own loss from unshifted ``labels`` and
  ``num_items_in_batch``, as ``Trainer.compute_loss`` calls it. ``tests/integrations`` runs it on a randomly
  initialized two-layer ``LlamaForCausalLM``: parity, one_sync, logged_loss and hygiene PASS in float32.

``ForCausalLMLoss`` upcasts the logits with ``.float()``, so the loss is computed in float32 also for a float64
model. The verdicts are asserted in both precisions: in the float64 lane parity fails by design, at float32 rounding
scale (finding ``float32_computation``), and ``--precision fp32`` is the lane that judges these recipes.

Verdicts the battery gives (W=2; ``harness.recipes.libraries.LIBRARY_RECIPES`` is the table the tests assert):

- global items: parity PASS in float32 (FAIL in float64: float32 computation); one_sync PASS; logged_loss PASS;
  hygiene PASS; empty_window FAIL: with no supervised token anywhere ``num_items_in_batch`` is 0, the loss is 0/0 =
  NaN (what the step returns) while every gradient is zero (cross-entropy gives ignored positions none), and the
  Trainer does not stop: its optimizer steps on nothing (``logging_nan_inf_filter`` only hides the logged value).
- local items: parity FAIL on the uneven scenario (rank 0 and rank 1 hold different counts); logged_loss FAIL (the
  mean of local means again); one_sync and hygiene PASS; empty_window FAIL as above. The gradient diagnosis reads
  ``mean_of_local_means`` on every failing parity case (in the float64 lane too: the re-weighting dominates the
  float32 rounding); on the single window (k=1) its sentence adds that those counts cannot tell it from
  ``per_microbatch_mean``. The global-items recipe's float64 failure reads ``float32_computation``.

What to change: keep ``average_tokens_across_devices=True`` (the default) for data-parallel training; skip the step
when the gathered ``num_items_in_batch`` is 0 (a custom ``training_step`` or a collator that never yields a window
without supervised tokens).

transformers is imported with this module when it is installed (the launcher's forkserver then imports it once, not
in every rank of every launch); without it the module still imports and ``setup()`` raises naming the extra.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.recipes.libraries._common import all_reduce_sum, local_count, missing, sync_last, world_size

_ForCausalLMLoss: Callable[..., torch.Tensor] | None
try:
    from transformers.loss.loss_utils import ForCausalLMLoss as _ForCausalLMLoss
except ImportError:  # the integrations extra is not installed: setup() says so
    _ForCausalLMLoss = None


class _TrainerLoss:
    """The Trainer's loop around ``ForCausalLMLoss``; ``average_tokens_across_devices`` picks the two recipes."""

    name = "transformers_loss"
    average_tokens_across_devices = True

    def __init__(self) -> None:
        self.loss_fn: Callable[..., torch.Tensor] | None = None

    def setup(self) -> None:
        if _ForCausalLMLoss is None:
            raise missing("transformers")
        self.loss_fn = _ForCausalLMLoss

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float:
        loss_fn = self.loss_fn
        if loss_fn is None:
            raise RuntimeError("setup() was not called before the first window")
        world = world_size()
        # Trainer._get_num_items_in_batch: the count of the window's labels, gathered (summed) over the processes
        # when average_tokens_across_devices is on, this rank's own otherwise.
        items: Any = torch.tensor(local_count(window))
        if self.average_tokens_across_devices and world > 1:
            items = all_reduce_sum(int(items), torch.int64)
        tr_loss = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(window):
            with sync_last(model, i, len(window)):
                logits = model(mb.inputs)
                loss = loss_fn(logits, mb.labels, vocab_size=logits.shape[-1], num_items_in_batch=items,
                               ignore_index=IGNORE_INDEX, shift_labels=mb.labels)
                if self.average_tokens_across_devices:
                    loss = loss * world  # Trainer.compute_loss: loss *= accelerator.num_processes
                loss.backward()
            tr_loss += loss.detach().double()
        # What the Trainer logs: the mean over processes of each one's summed step losses.
        return float(all_reduce_sum(float(tr_loss))) / world


class TransformersGlobalItems(_TrainerLoss):
    """``average_tokens_across_devices=True``: the gathered count and the world-size factor."""

    name = "transformers_global_items"
    average_tokens_across_devices = True


class TransformersLocalItems(_TrainerLoss):
    """``average_tokens_across_devices=False``: this rank's count, no factor (a mean of local means)."""

    name = "transformers_local_items"
    average_tokens_across_devices = False


class TransformersGlobalItemsHF(TransformersGlobalItems):
    """The global-items Trainer step on a transformers model with the ``hf`` batch format (``--batch-format hf``):
    each microbatch is ``{"input_ids", "attention_mask", "labels"}`` with unshifted labels, the model computes its own
    loss from ``labels`` and ``num_items_in_batch`` (``self.loss_function``, which shifts), as ``Trainer.compute_loss``
    calls it; the count is the Trainer's, over ``labels[..., 1:]``."""

    name = "transformers_global_items_hf"

    def backward_window(self, model: nn.Module, window: Sequence[Any]) -> float:
        if self.loss_fn is None:
            raise RuntimeError("setup() was not called before the first window")
        world = world_size()
        local = sum(int(batch["labels"][..., 1:].ne(IGNORE_INDEX).sum()) for batch in window)
        items = all_reduce_sum(local, torch.int64) if world > 1 else torch.tensor(local)
        tr_loss = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(window):
            with sync_last(model, i, len(window)):
                loss = model(**batch, num_items_in_batch=items).loss * world
                loss.backward()
            tr_loss += loss.detach().double()
        return float(all_reduce_sum(float(tr_loss))) / world


transformers_global_items = TransformersGlobalItems
transformers_local_items = TransformersLocalItems
transformers_global_items_hf = TransformersGlobalItemsHF
