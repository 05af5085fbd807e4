"""accelerate's ``accumulate`` loop as a battery recipe: the guide's loop, and the same loop fixed.

accelerate's gradient-accumulation guide writes each step as::

    accelerator = Accelerator(gradient_accumulation_steps=2)
    for batch in dataloader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(batch["inputs"]), batch["labels"])   # a mean over this batch's tokens
            accelerator.backward(loss)
            optimizer.step(); optimizer.zero_grad()

Adapted to the recipe contract, ``model`` is the DDP-wrapped model the battery hands the recipe (not given to
``prepare``: it would wrap the DDP in a second DDP) and the window's microbatches are the batches of one optimizer
step (the battery steps after the window). ``Accelerator(cpu=True)`` on a machine without a GPU: accelerate decides
it is distributed from environment variables and devices, and otherwise its ``no_sync`` does nothing.

- ``wrong``: the guide's loop. ``accumulate`` syncs when its own counter reaches a multiple of
  ``gradient_accumulation_steps``, not where the window ends (a one-microbatch window never syncs); ``backward``
  divides every loss by it; each loss is a mean over its own microbatch. The battery reads ``per_microbatch_mean``
  (and ``not_synchronized`` on a one-microbatch window).
- ``recipe``: the same ``accumulate`` and ``backward``, told the window's length (``gradient_accumulation_steps =
  len(window)``, ``step = 0``), with the loss sum over the window's global supervised count times ``num_processes``
  (DDP averages) and ``gradient_accumulation_steps`` (``backward`` divides): the global token mean.

Check them from your own directory (this file on ``PYTHONPATH``)::

    python -m harness battery --recipe accelerate_loop:recipe --battery-world-sizes 2 --precision fp32 \
        --battery-examples 0
    python -m harness battery --recipe accelerate_loop:wrong --battery-world-sizes 2 --precision fp32 \
        --battery-examples 0
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator


class AccelerateLoop:
    name = "accelerate_loop"

    def setup(self):
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)

    def backward_window(self, model, window):
        losses = []
        for mb in window:
            with self.accelerator.accumulate(model):
                loss = F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=-100)
                self.accelerator.backward(loss)
            losses.append(loss.detach())
        return float(self.accelerator.reduce(torch.stack(losses).mean(), reduction="mean"))


class AccelerateLoopFixed(AccelerateLoop):
    name = "accelerate_loop_fixed"

    def backward_window(self, model, window):
        accelerator = self.accelerator
        n = int(accelerator.reduce(torch.tensor(sum(int((mb.labels != -100).sum()) for mb in window)), "sum"))
        if n == 0:
            raise ValueError("no supervised token in this window on any rank")  # every rank raises alike
        accelerator.gradient_accumulation_steps = len(window)  # sync on this window's last microbatch, and only there
        accelerator.step = 0
        logged = torch.zeros((), dtype=torch.float64)
        for mb in window:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=-100,
                                       reduction="sum")
                accelerator.backward(loss * accelerator.num_processes * len(window) / n)
            logged += loss.detach()
        return float(accelerator.reduce(logged, "sum")) / n


recipe = AccelerateLoopFixed()
wrong = AccelerateLoop()
