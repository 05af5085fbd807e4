"""transformers' ``Trainer`` inner loop as a battery recipe: ``average_tokens_across_devices`` on (right) and off.

``Trainer._inner_training_loop`` (transformers 5.25) runs each optimizer step as::

    batch_samples, num_items_in_batch = self.get_batch_samples(epoch_iterator, num_batches, self.args.device)
    for i, inputs in enumerate(batch_samples):
        sync_context = nullcontext if i == len(batch_samples) - 1 else partial(self.accelerator.no_sync, model=model)
        with sync_context():
            tr_loss_step = self.training_step(model, inputs, num_items_in_batch)

and logs ``nested_gather(tr_loss, args.parallel_mode).mean()``. Adapted to the recipe contract, the window's
microbatches are the ``epoch_iterator``, ``model`` is the DDP-wrapped model the battery hands the recipe, and the
``Trainer`` is built around its ``model.module``. Two things a real loop does not meet:

- ``Trainer.__init__`` calls ``set_seed(args.seed)``, which moves Python's, numpy's and torch's global generators;
  the battery fails a recipe that moves them, so the ``Trainer`` is built with the generators put back afterwards.
- The battery's model returns logits from ``model(inputs=...)``: ``compute_loss_func`` computes transformers'
  causal-LM loss from them (its labels already aligned: ``shift_labels=``). With a transformers model
  (``--model your.module:factory --batch-format hf``), drop ``compute_loss_func`` and pass the batches as they are.

``ForCausalLMLoss`` computes in float32 (``.float()`` on the logits): on the battery's built-in model the float64
lane's parity fails reading ``float32_computation``, so the commands below judge the loop with ``--precision fp32``.

- ``recipe``: ``TrainingArguments(average_tokens_across_devices=True)``, the default: the global token mean.
- ``wrong``: ``average_tokens_across_devices=False``: each rank divides by its own count, DDP averages: the battery
  reads ``mean_of_local_means``.

Check them from your own directory (this file on ``PYTHONPATH``)::

    python -m harness battery --recipe trainer_loop:recipe --battery-world-sizes 2 --precision fp32 --battery-examples 0
    python -m harness battery --recipe trainer_loop:wrong --battery-world-sizes 2 --precision fp32 --battery-examples 0
"""

from __future__ import annotations

import contextlib
import functools
import random
import tempfile

import numpy as np
import torch
from transformers import Trainer, TrainingArguments
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.trainer_pt_utils import nested_gather


def causal_lm_loss(logits, labels, num_items_in_batch=None):
    return ForCausalLMLoss(logits, None, logits.shape[-1], num_items_in_batch, shift_labels=labels)


def build_trainer(model, average_tokens_across_devices):
    """A ``Trainer`` around ``model``, with the global generators ``Trainer.__init__`` seeds put back."""
    args = TrainingArguments(output_dir=tempfile.gettempdir(), report_to="none", use_cpu=True,
                             average_tokens_across_devices=average_tokens_across_devices)
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    trainer = Trainer(model=model, args=args, compute_loss_func=causal_lm_loss)
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    return trainer


class TrainerLoop:
    name = "trainer_loop"

    def __init__(self, average_tokens_across_devices=True):
        self.average_tokens_across_devices = average_tokens_across_devices
        self.trainer = None

    def backward_window(self, model, window):
        if self.trainer is None:
            self.trainer = build_trainer(model.module, self.average_tokens_across_devices)
        t = self.trainer
        batches = iter([{"inputs": mb.inputs, "labels": mb.labels} for mb in window])
        batch_samples, num_items_in_batch = t.get_batch_samples(batches, len(window), t.args.device)
        tr_loss = torch.zeros(())
        for i, inputs in enumerate(batch_samples):
            last = i == len(batch_samples) - 1
            sync_context = contextlib.nullcontext if last else functools.partial(t.accelerator.no_sync, model=model)
            with sync_context():
                tr_loss += t.training_step(model, inputs, num_items_in_batch)
        return float(nested_gather(tr_loss, t.args.parallel_mode).mean())


recipe = TrainerLoop(average_tokens_across_devices=True)
wrong = TrainerLoop(average_tokens_across_devices=False)
