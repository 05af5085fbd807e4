"""transformers' own ``Trainer`` inner loop as a recipe, the way a user adapts it: the real ``Trainer`` (built once,
around the harness's model, its global generators restored after ``set_seed``), ``get_batch_samples`` for the
window's microbatches and their gathered ``num_items_in_batch``, then ``training_step`` per microbatch under
``accelerator.no_sync`` for all but the last, and the logged loss the mean over processes of the summed step losses
(``nested_gather(tr_loss).mean()``), returned as the float32 tensor it is. ``--batch-format hf``, a transformers
``--model`` (``integrations.hf_models:tiny_llama``)."""

from __future__ import annotations

import contextlib
import random
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn


class TrainerInnerLoop:
    name = "trainer_inner_loop"

    def __init__(self) -> None:
        self.trainer: Any = None

    def _build(self, model: nn.Module, steps: int) -> Any:
        from transformers import Trainer, TrainingArguments

        # Trainer.__init__ calls set_seed(args.seed): a user's loop seeds once; the battery's ranks keep theirs.
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="trainer-loop-"), per_device_train_batch_size=1,
                                 gradient_accumulation_steps=steps, average_tokens_across_devices=True,
                                 use_cpu=True, report_to=[], logging_strategy="no", save_strategy="no")
        trainer = Trainer(model=getattr(model, "module", model), args=args)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        return trainer

    def backward_window(self, model: nn.Module, window: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
        if self.trainer is None:
            self.trainer = self._build(model, len(window))
        trainer = self.trainer
        device = next(model.parameters()).device
        batches, num_items = trainer.get_batch_samples(iter(window), len(window), device)
        tr_loss = torch.zeros((), device=device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else trainer.accelerator.no_sync(model=model):
                tr_loss = tr_loss + trainer.training_step(model, batch, num_items)
        from transformers.trainer_pt_utils import nested_gather

        return nested_gather(tr_loss.detach().unsqueeze(0), trainer.args.parallel_mode).mean()


trainer_inner_loop = TrainerInnerLoop
