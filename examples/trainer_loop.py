"""transformers' ``Trainer`` inner loop as a battery recipe, on a Llama built from a config:
``average_tokens_across_devices`` on (right) and off.

``Trainer._inner_training_loop`` (transformers 5.25) runs each optimizer step as::

    batch_samples, num_items_in_batch = self.get_batch_samples(epoch_iterator, num_batches, self.args.device)
    for i, inputs in enumerate(batch_samples):
        sync_context = nullcontext if i == len(batch_samples) - 1 else partial(self.accelerator.no_sync, model=model)
        with sync_context():
            tr_loss_step = self.training_step(model, inputs, num_items_in_batch)

and logs ``nested_gather(tr_loss, args.parallel_mode).mean()``. Adapted to the recipe contract, the window's
microbatches are the ``epoch_iterator`` (under ``--batch-format hf`` they are the dicts a transformers model takes:
``input_ids``, ``attention_mask``, unshifted ``labels``), ``model`` is the DDP-wrapped model the battery hands the
recipe, and the ``Trainer`` is built once, in ``setup(model)``, around its ``model.module``. ``Trainer.__init__``
calls ``set_seed(args.seed)``, which moves Python's, numpy's and torch's global generators: the battery fails a
recipe that moves them (its hygiene check names ``set_seed`` and the line that built the ``Trainer``), so it is built
inside ``harness.recipes.generators_kept()``, which puts them back.

- ``recipe``: ``TrainingArguments(average_tokens_across_devices=True)``, the default: the global token mean.
- ``wrong``: ``average_tokens_across_devices=False``: each rank divides by its own count, DDP averages: the battery
  reads ``mean_of_local_means``.

Check them from your own directory (this file on ``PYTHONPATH``; ``tiny_llama`` is the model)::

    python -m harness battery --recipe trainer_loop:recipe --model trainer_loop:tiny_llama --batch-format hf --quick
    python -m harness battery --recipe trainer_loop:recipe --model trainer_loop:tiny_llama --batch-format hf
    python -m harness battery --recipe trainer_loop:wrong --model trainer_loop:tiny_llama --batch-format hf --quick
"""

from __future__ import annotations

import contextlib
import functools
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.trainer_pt_utils import nested_gather

from harness.recipes import generators_kept


def tiny_llama():
    """A two-layer Llama from a config, the battery's vocabulary (32) and row lengths (up to 128 positions)."""
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


class TrainerLoop:
    name = "trainer_loop"

    def __init__(self, average_tokens_across_devices=True):
        self.average_tokens_across_devices = average_tokens_across_devices

    def setup(self, model):
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True,
                                 average_tokens_across_devices=self.average_tokens_across_devices)
        with generators_kept():  # Trainer.__init__ seeds the global generators
            self.trainer = Trainer(model=model.module, args=args)

    def backward_window(self, model, window):
        t = self.trainer
        batch_samples, num_items_in_batch = t.get_batch_samples(iter(window), len(window), t.args.device)
        tr_loss = torch.zeros(())
        for i, inputs in enumerate(batch_samples):
            last = i == len(batch_samples) - 1
            sync_context = contextlib.nullcontext if last else functools.partial(t.accelerator.no_sync, model=model)
            with sync_context():
                tr_loss += t.training_step(model, inputs, num_items_in_batch)
        return float(nested_gather(tr_loss, t.args.parallel_mode).mean())


recipe = TrainerLoop(average_tokens_across_devices=True)
wrong = TrainerLoop(average_tokens_across_devices=False)
