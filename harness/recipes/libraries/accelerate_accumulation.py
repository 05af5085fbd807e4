"""accelerate's gradient accumulation under data parallelism: the documented loop, and the same library corrected.

Tested with accelerate 1.15.0 (torch 2.13.0). Both recipes build ``Accelerator(gradient_accumulation_steps=2,
cpu=True)`` in ``setup()`` (once per rank, inside the harness's process group): accelerate decides it is
distributed from environment variables and devices, not from ``torch.distributed.is_initialized()``, and on a machine
without a GPU it says "not distributed" (and ``no_sync`` does nothing) unless told ``cpu=True``. With ``cpu=True`` it
finds the launcher's ``RANK``/``WORLD_SIZE``, keeps the process group it finds (it never initializes a second one),
sets ``MASTER_PORT`` if unset and the intra-op thread count if ``OMP_NUM_THREADS`` is unset. The model is not given to
``accelerator.prepare``: the harness has wrapped it in DDP already, and ``prepare`` would wrap that DDP in a second
DDP (accelerate recognizes only models it prepared itself); ``accumulate(model)`` and ``no_sync(model)`` only need
the wrapper's ``no_sync``, so the harness's model is passed to them as it is.

- ``accelerate_naive``: the loop of accelerate's gradient-accumulation guide, as users write it::

      with accelerator.accumulate(model):
          loss = F.cross_entropy(model(inputs), labels)    # a mean over this microbatch's tokens
          accelerator.backward(loss)

  Three departures from the global token mean: each microbatch is a mean over its own tokens (not the window's),
  ``backward`` divides every loss by ``gradient_accumulation_steps`` whatever the window's length, and DDP averages
  the ranks' results (a mean of means). And ``accumulate`` synchronizes when its own step counter reaches a multiple
  of ``gradient_accumulation_steps``, not at the window's end: a window of one microbatch (a short final window)
  never synchronizes, and a longer one synchronizes in its middle. The logged loss is
  ``accelerator.reduce(mean of the microbatch losses, "mean")``.
- ``accelerate_corrected``: the same ``Accelerator`` and the same ``accumulate(model)`` / ``accelerator.backward``
  loop, with the window's supervised count summed over the ranks before any backward (``ValueError`` on every rank
  when it is 0), each microbatch's loss *sum* scaled by ``num_processes * gradient_accumulation_steps / count`` (the
  last factor undoes ``backward``'s division), and ``accumulate`` told where the window ends: before the window
  ``accelerator.gradient_accumulation_steps = len(window)`` and ``accelerator.step = 0``, so its counter reaches a
  multiple of the steps on the window's last microbatch and only there (a short final window included). The loss is
  computed in the model's dtype, so the verdicts hold in both precisions.

Verdicts the battery gives (W=2; ``harness.recipes.libraries.LIBRARY_RECIPES`` is the table the tests assert):

- naive: parity FAIL on the uneven scenario (the mean of per-microbatch means, halved by ``backward``), and on the
  single scenario (no synchronization: each rank keeps its own gradient); one_sync PASS on the uneven window of two
  microbatches, FAIL on the single one (0 synchronizations); logged_loss FAIL (a mean of means); hygiene PASS;
  empty_window FAIL (a mean over no token is NaN: NaN returned, zero gradients, no error).
- corrected: every check PASS.

What the gradient diagnosis reads (``harness.battery.diagnose.of_run``; the tests assert the signatures): on the uneven
window ``per_microbatch_mean`` exactly, in both lanes (each microbatch's tokens weigh ``1/(k * W * its own count)``:
the ``1/k`` is ``backward``'s division by ``gradient_accumulation_steps``, here equal to the window's k=2). On the
single window it reads ``not_synchronized``: rank 0's gradient holds rank 1's microbatch at weight 0 (never
synchronized) and its own at ``1/(2 * 156)`` where the global token mean gives ``1/553``: a ratio of 1.77 (rank 1's
reads 0.70), not the W a right loss left unsynchronized would give, because accelerate's loss is also a local mean
halved by ``backward``; the sentence names that ratio.

What to change: normalize by the global token count (the window's ``labels != -100`` summed with
``accelerator.reduce``), multiply the loss sum by ``num_processes`` and by ``gradient_accumulation_steps``, set
``accelerator.gradient_accumulation_steps`` to the window's length and ``accelerator.step`` to 0 before each window
(or put ``accelerator.no_sync(model)`` around all microbatches but the window's last instead of ``accumulate``), and
stop on a zero global count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.core.loss import check_global_count
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.recipes.libraries._common import local_count, missing

try:
    import accelerate as _accelerate
except ImportError:  # the integrations extra is not installed: setup() says so
    _accelerate = None

ACCUMULATION_STEPS = 2
"""``Accelerator(gradient_accumulation_steps=...)``: the length of the battery's base (uneven) window."""


class _AccelerateRecipe:
    name = "accelerate"

    def __init__(self) -> None:
        self.accelerator: Any = None

    def setup(self) -> None:
        if _accelerate is None:
            raise missing("accelerate")
        self.accelerator = _accelerate.Accelerator(gradient_accumulation_steps=ACCUMULATION_STEPS, cpu=True)

    def _ready(self) -> Any:
        if self.accelerator is None:
            raise RuntimeError("setup() was not called before the first window")
        return self.accelerator


class AccelerateNaive(_AccelerateRecipe):
    """The guide's loop: ``accumulate(model)``, a mean loss per microbatch, ``accelerator.backward``."""

    name = "accelerate_naive"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float:
        accelerator = self._ready()
        losses = []
        for mb in window:
            with accelerator.accumulate(model):
                logits = model(mb.inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX)
                accelerator.backward(loss)
                # optimizer.step() and optimizer.zero_grad() belong here in the guide; the harness steps after the
                # window, and accelerate's prepared optimizer skips the step while gradients are not synchronized.
            losses.append(loss.detach())
        return float(accelerator.reduce(torch.stack(losses).mean(), reduction="mean"))


class AccelerateCorrected(_AccelerateRecipe):
    """The same ``accumulate`` loop: the global count, ``num_processes * gradient_accumulation_steps / count``, and
    ``accumulate``'s counter set to sync on the window's last microbatch."""

    name = "accelerate_corrected"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float:
        accelerator = self._ready()
        total = int(accelerator.reduce(torch.tensor(local_count(window)), reduction="sum"))
        check_global_count(total)  # ValueError on every rank alike, before any backward
        # accumulate() syncs when its own counter reaches a multiple of gradient_accumulation_steps, not where the
        # window ends: a window of another length (a short final one) would sync in its middle or never. Telling it
        # the window's length and starting the count here makes the last microbatch the only synchronized one.
        accelerator.gradient_accumulation_steps = len(window)
        accelerator.step = 0
        # backward() divides by gradient_accumulation_steps and DDP averages over the processes: both undone here.
        scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / total
        local = torch.zeros((), dtype=torch.float64)
        for mb in window:
            with accelerator.accumulate(model):
                logits = model(mb.inputs)
                s = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
                accelerator.backward(s * scale)
            local += s.detach().double()
        return float(accelerator.reduce(local, reduction="sum")) / total


accelerate_naive = AccelerateNaive
accelerate_corrected = AccelerateCorrected
