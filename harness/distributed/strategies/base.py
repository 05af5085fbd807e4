"""The strategy protocol and the registry every strategy module adds itself to (see the package's docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn


class Wrapped(Protocol):
    """One rank's model under a strategy."""

    @property
    def module(self) -> nn.Module:
        """What the recipe receives (the wrapper)."""
        ...

    @property
    def local(self) -> nn.Module:
        """The model itself, its parameters in model order."""
        ...

    @property
    def no_sync(self) -> str:
        """How a recipe skips a synchronization under this strategy, for messages (``"model.no_sync()"``)."""
        ...

    @property
    def syncs(self) -> int:
        """Synchronizations since the last :meth:`reset_syncs` (a window's count)."""
        ...

    def reset_syncs(self) -> None: ...

    def notes(self) -> tuple[str, ...]:
        """What the strategy's own state says about a wrong result (FSDP2's divisor knobs set on some sharded
        modules only), for the failing verdict's message; empty when nothing is amiss."""
        ...

    def full_grad(self) -> torch.Tensor:
        """Every parameter's full gradient, flat, model order, on the CPU (zeros where there is none)."""
        ...

    def full_params(self) -> torch.Tensor:
        """Every parameter in full, flat, model order, on the CPU."""
        ...


class Strategy(Protocol):
    name: str

    def wrap(self, model: nn.Module, device: torch.device, *, find_unused: bool = False, reduction: str = "mean",
             count_syncs: bool = True, on_comm_hook: Callable[[], None] | None = None,
             mixed_precision: torch.dtype | None = None, mesh: Any = None, experts: Any = None) -> Wrapped:
        """Wrap ``model`` (already on ``device``) for this rank. ``find_unused``: parameters may miss a gradient in a
        backward; ``reduction``: ``"mean"`` (the default of data parallelism) or ``"sum"``; ``count_syncs``: count
        synchronizations (the battery does, a training loop need not); ``on_comm_hook``: called instead of
        registering when the code under test tries to install a communication hook of its own;
        ``mixed_precision``: the dtype the strategy itself computes in when it has a policy for it (FSDP2's
        ``MixedPrecisionPolicy``; None: the model's own dtype; DDP has none and ignores it: the harness runs the
        recipe under autocast instead); ``mesh``: the ``DeviceMesh`` the gradient is reduced over (DDP all-reduces
        over its group, FSDP2 shards over it; a 2-D one is HSDP's replicate x shard; None: every rank); ``experts``: the
        rank's :class:`harness.distributed.expert_parallel.ExpertLayout` when the model's experts are spread over
        ep (they reduce over the expert-data group, not ``mesh``)."""
        ...


STRATEGIES: dict[str, Strategy] = {}
"""Every strategy by name, filled as each strategy module registers itself (:func:`register`)."""


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` under its name (a second one with the same name is an error)."""
    if strategy.name in STRATEGIES:
        msg = f"strategy {strategy.name!r} is registered twice"
        raise ValueError(msg)
    STRATEGIES[strategy.name] = strategy
    return strategy


def get(name: str) -> Strategy:
    """The strategy called ``name``; ValueError naming the known ones otherwise."""
    if name not in STRATEGIES:
        msg = f"strategy={name!r} must be one of {', '.join(sorted(STRATEGIES))}"
        raise ValueError(msg)
    return STRATEGIES[name]


__all__ = ["STRATEGIES", "Strategy", "Wrapped", "get", "register"]
