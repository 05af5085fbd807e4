"""What an audit recorded, as plain data: each audited window's starting weights, its model calls' batches and the
gradient at ``optimizer.step()`` (:class:`Window`), and the run around them (:class:`Record`).
:mod:`harness.audit.watch` fills it; :mod:`harness.audit.evidence` reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Call:
    """One outermost model call's batch, on the CPU."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None
    attention_mask: torch.Tensor | None


@dataclass
class Window:
    """One audited window: the weights when it started, its calls, and the gradient at ``optimizer.step()``."""

    start: torch.Tensor
    calls: list[Call] = field(default_factory=list)
    grad: torch.Tensor | None = None
    syncs: int | None = None
    """The calls whose backward DDP synchronizes (its ``require_backward_grad_sync`` set, gradients on, as DDP reads
    them at each forward); None when the model is not wrapped by DDP."""


class Record:
    """An audit's record: ``wanted`` windows after ``skip`` optimizer steps; the model (the outermost module called),
    the windows recorded, the optimizer steps seen, and what could not be read."""

    def __init__(self, windows: int, skip: int) -> None:
        if windows < 1:
            msg = f"windows={windows} must be at least 1: the number of optimizer steps to audit"
            raise ValueError(msg)
        if skip < 0:
            msg = f"skip={skip} must be 0 or more: the optimizer steps to let pass before the audited windows"
            raise ValueError(msg)
        self.wanted, self.skip = windows, skip
        self.model: nn.Module | None = None
        self.windows: list[Window] = []
        self.steps = 0
        self.problems: list[str] = []


__all__ = ["Call", "Record", "Window"]
