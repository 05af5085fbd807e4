"""``DistributedDataParallel``: every rank holds the whole model, gradients are averaged over ranks by an all-reduce.

The one place the harness builds a DDP. Synchronizations are counted by the harness's communication hook
(:mod:`harness.distributed.hooks`), which also reduces like DDP's default (or sums); a DDP model takes one hook, so
code under test that tries to register its own is answered by ``on_comm_hook`` instead of DDP's "can only be called
once". A recipe skips a synchronization with ``model.no_sync()`` around the forward and backward of every microbatch
but the last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.core.compare import flat_grad, flat_params
from harness.distributed.hooks import SyncCounter, attach
from harness.distributed.strategies.base import register


class DDPWrapped:
    """One rank's model wrapped in DDP."""

    def __init__(self, model: nn.Module, device: torch.device, *, find_unused: bool, reduction: str,
                 count_syncs: bool, on_comm_hook: Callable[[], None] | None, mesh: Any = None,
                 experts: Any = None) -> None:
        self.local: nn.Module = model
        group = None if mesh is None else mesh.get_group()
        if experts is not None:
            # Expert parameters are not replicated over DDP's group: they reduce over the expert-data group
            # (harness.distributed.expert_parallel), never through DDP's buckets.
            DDP._set_params_and_buffers_to_ignore_for_model(model, list(experts.experts))
        self.module: DDP = DDP(model, device_ids=[device] if device.type == "cuda" else None,
                               find_unused_parameters=find_unused, process_group=group)
        # The hook reduces over DDP's own group: a pipeline stage's DDP spans the ranks of its stage only.
        self._counter: SyncCounter | None = attach(self.module, reduction, group) if count_syncs else None
        self.no_sync: str = "model.no_sync()"
        if on_comm_hook is not None:
            def refuse(*args: object, **kwargs: object) -> None:
                on_comm_hook()

            self.module.register_comm_hook = refuse  # type: ignore[method-assign]
        if experts is not None and not experts.reduced_by_recipe:
            from harness.distributed.expert_parallel import ExpertReducer

            self._experts = ExpertReducer(self.module, experts.held_parameters(model), experts)

    @property
    def syncs(self) -> int:
        return 0 if self._counter is None else self._counter.syncs

    def reset_syncs(self) -> None:
        if self._counter is not None:
            self._counter.syncs = 0

    def notes(self) -> tuple[str, ...]:
        return ()

    def full_grad(self) -> torch.Tensor:
        return flat_grad(self.local)  # replicated: every rank holds every gradient after the all-reduce

    def full_params(self) -> torch.Tensor:
        return flat_params(self.local)


class DDPStrategy:
    name = "ddp"

    def wrap(self, model: nn.Module, device: torch.device, *, find_unused: bool = False, reduction: str = "mean",
             count_syncs: bool = True, on_comm_hook: Callable[[], None] | None = None,
             mixed_precision: torch.dtype | None = None, mesh: Any = None, experts: Any = None) -> DDPWrapped:
        return DDPWrapped(model, device, find_unused=find_unused, reduction=reduction, count_syncs=count_syncs,
                          on_comm_hook=on_comm_hook, mesh=mesh, experts=experts)


register(DDPStrategy())

__all__ = ["DDPStrategy", "DDPWrapped"]
