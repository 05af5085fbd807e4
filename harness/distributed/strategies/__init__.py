"""Data-parallel strategies: one module per way of spreading a model over ranks, behind one small protocol.

A strategy wraps a model on every rank, counts the gradient synchronizations of each window, reads back the full
gradient and the full parameters as flat float tensors in model order on every rank (a sharded strategy gathers
them), and names the context a recipe uses to skip a synchronization. The battery's runner, the trainer, the report
and the scaling table ask for a strategy by name (:func:`get`) and build nothing themselves: a second strategy is a new
module here that registers itself, not edits across them: DDP (:mod:`.ddp`) and FSDP2 (:mod:`.fsdp2`).
"""

from __future__ import annotations

from harness.distributed.strategies import ddp, fsdp2
from harness.distributed.strategies.base import STRATEGIES, Strategy, Wrapped, get, register

__all__ = ["STRATEGIES", "Strategy", "Wrapped", "ddp", "fsdp2", "get", "register"]
