"""A recipe that crashes on one rank: the battery must name the rank and keep the exception line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class CrashesOnRankOne:
    name = "crashes_on_rank_one"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        if dist.get_rank() == 1:
            raise KeyError("labels")  # a batch key this rank's loader did not produce
        model(window[0].inputs).sum().backward()


class KilledOnRankThree:
    """A worker that dies mid-battery (the out-of-memory killer, a node lost): rank 3 SIGKILLs itself in its first
    window; under torchrun the job must end, not wait for it."""

    name = "killed_on_rank_three"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        import os
        import signal

        if dist.get_rank() == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        model(window[0].inputs).sum().backward()


class DictOnlyAuxiliary:
    """A recipe whose auxiliary term reads a dict batch (``batch["input_ids"]``) while the battery feeds harness
    microbatches: its ``auxiliary_loss`` raises a TypeError when the reference computes the term. The recipe's
    error: refused before any rank, never taken for a limit of the model (which would turn every case n/a)."""

    name = "dict_only_auxiliary"
    auxiliary_unit = "microbatch"

    def auxiliary_loss(self, model: torch.nn.Module, batch: Any, logits: torch.Tensor) -> torch.Tensor:
        return batch["input_ids"].float().sum() * 0.0

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        model(window[0].inputs).sum().backward()
