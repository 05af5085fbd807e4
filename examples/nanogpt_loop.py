"""nanoGPT's micro-step loop as a battery recipe: the loop as its ``train.py`` writes it, and the same loop fixed.

nanoGPT's ``train.py`` accumulates ``gradient_accumulation_steps`` micro-steps per optimizer step::

    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        logits, loss = model(X, Y)                      # a mean over this micro-step's tokens
        loss = loss / gradient_accumulation_steps
        loss.backward()

Adapted to the recipe contract (``backward_window(model, window)``: ``model`` is the DDP-wrapped model, ``window``
this rank's micro-steps, each with ``.inputs`` and ``.labels``), ``gradient_accumulation_steps`` is ``len(window)``.
The battery's model returns logits only, so the loss is computed from them; its labels mark unsupervised positions
with -100 (nanoGPT's loss ignores -1: map it, or pass ``ignore_index=-100``).

- ``wrong``: the loop as written. Each micro-step's loss is a mean over its own tokens, so a token weighs more in a
  micro-step with fewer tokens, and DDP averages the ranks' results: the battery reads ``per_microbatch_mean``.
- ``recipe``: the loss *sum* over the window's supervised tokens counted on every rank (all-reduced before the first
  backward), times the world size (DDP averages): the global token mean.

Check them from your own directory (this file on ``PYTHONPATH``)::

    python -m harness battery --recipe nanogpt_loop:recipe --battery-world-sizes 2 --precision fp32 --battery-examples 0
    python -m harness battery --recipe nanogpt_loop:wrong --battery-world-sizes 2 --precision fp32 --battery-examples 0
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class NanoGPTLoop:
    """nanoGPT's loop as written: ``loss / gradient_accumulation_steps`` of each micro-step's mean."""

    name = "nanogpt_loop"

    def backward_window(self, model, window):
        gradient_accumulation_steps = len(window)
        for micro_step, mb in enumerate(window):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            logits = model(mb.inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=-100)
            loss = loss / gradient_accumulation_steps
            loss.backward()
        return float(loss) * gradient_accumulation_steps  # what nanoGPT logs: the last micro-step's mean


class NanoGPTLoopFixed:
    """The same loop: the loss sum over the window's global supervised count, times the world size."""

    name = "nanogpt_loop_fixed"

    def backward_window(self, model, window):
        gradient_accumulation_steps = len(window)
        n = torch.tensor(sum(int((mb.labels != -100).sum()) for mb in window))
        dist.all_reduce(n)  # the window's supervised tokens on every rank, before any backward
        if int(n) == 0:
            raise ValueError("no supervised token in this window on any rank")  # every rank raises alike
        logged = torch.zeros((), dtype=torch.float64)
        for micro_step, mb in enumerate(window):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            logits = model(mb.inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=-100, reduction="sum")
            (loss * dist.get_world_size() / n).backward()  # DDP averages over the ranks: the world size undoes it
            logged += loss.detach()
        dist.all_reduce(logged)
        return float(logged / n)  # the global token mean, the same on every rank


recipe = NanoGPTLoopFixed()
wrong = NanoGPTLoop()
