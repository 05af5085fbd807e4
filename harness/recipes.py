"""Recipes: the training step under test, the correct one and the known mistakes.

A recipe's ``backward_window(model, window)`` runs on every rank with ``model`` wrapped in DDP (gradients averaged
over ranks) and ``window`` this rank's microbatches for one optimizer step. It must leave in ``.grad`` the gradient of
``(sum of per-token cross-entropy over every supervised token of every rank's window) / (number of those tokens)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from harness.batching import Microbatch
from harness.loss import check_global_count, count_device, global_count, global_token_loss, loss_sum


@runtime_checkable
class Recipe(Protocol):
    name: str

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None: ...


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def window_count(window: Sequence[Microbatch]) -> int:
    """The global supervised count of the window, all-reduced before any backward; ValueError (on every rank
    alike) when it is 0."""
    # Every rank calls global_count, also a rank whose own count is 0, and every rank sees the same total, so every
    # rank raises together and none is left waiting in a collective.
    total = global_count(sum(mb.supervised for mb in window))
    check_global_count(total)
    return total


def accumulate(
    model: nn.Module,
    window: Sequence[Microbatch],
    scale: Callable[[torch.Tensor], torch.Tensor],
    *,
    sync_every_microbatch: bool = False,
    loss_dtype: torch.dtype | None = None,
) -> float:
    """Forward and backward of every microbatch with loss ``scale(loss_sum)``; returns this rank's plain loss sum.

    In DDP only the last microbatch needs to synchronize gradients. The ``no_sync()`` context must hold the forward as
    well as the backward, or DDP still prepares a reduction for that pass. (``sync_every_microbatch`` and
    ``loss_dtype`` exist for the negative controls.)
    """
    local = 0.0
    for i, mb in enumerate(window):
        last = i == len(window) - 1
        with contextlib.nullcontext() if last or sync_every_microbatch else model.no_sync():  # type: ignore[operator]
            logits = model(mb.inputs)
            s = loss_sum(logits if loss_dtype is None else logits.to(loss_dtype), mb.labels)
            scale(s).backward()
        local += float(s.detach())
    return local


def global_sum(value: float) -> float:
    """All-reduce (SUM) a float in float64 on the count device; the identity outside a process group."""
    if not dist.is_initialized():
        return value
    t = torch.tensor(value, dtype=torch.float64, device=count_device())
    dist.all_reduce(t)
    return float(t)


class GlobalTokenMean:
    """The correct recipe: sums, one all-reduced count before any backward, ``no_sync`` around all but the last."""

    name = "global_token_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        # The logged loss must be the global token mean on every rank, not this rank's share of it.
        return global_sum(local) / total


global_token_mean = GlobalTokenMean()


# --- Negative controls -------------------------------------------------------------------------------------------
# Each reproduces a mistake real projects made. The battery must reject every one of them; tests assert that it does.


class MeanOfLocalMeans:
    """Seed 000's ``wrong=True``: each rank divides by its *local* count, and DDP averages the local means.

    Right only when every rank holds the same number of tokens (or the same local mean), which is why the battery's
    uneven fixture exists.
    """

    name = "mean_of_local_means"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        local = sum(mb.supervised for mb in window)
        accumulate(model, window, lambda s: s / max(local, 1))
        return None


class ExtraMicrobatchDivision:
    """The correct normalization, then divided again by the number of microbatches (seed 000: 2.5 becomes 1.25)."""

    name = "extra_microbatch_division"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world) / len(window))
        return None


class NoWorldSizeFactor:
    """Each rank backpropagates ``S_r / N``: DDP's average then divides the gradient by W once too often."""

    name = "no_world_size_factor"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total = window_count(window)
        accumulate(model, window, lambda s: s / total)
        return None


class SkipBackwardWhenEmpty:
    """A rank with no supervised token returns without forward or backward: its peers wait in DDP's all-reduce
    (or, worse, pair with its next collective of the same size)."""

    name = "skip_backward_when_empty"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        if sum(mb.supervised for mb in window) == 0:
            return None
        accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return None


class NeverNoSync:
    """Right numbers, but every microbatch synchronizes: W-1 extra all-reduces of every gradient per window.
    Parity cannot see it (gradients agree within ~6e-8); only the synchronization count can."""

    name = "never_no_sync"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world), sync_every_microbatch=True)
        return None


class Float32Loss:
    """The correct recipe computing its loss in float32 (a stray ``.float()``, an autocast region).

    Invisible at float32, where it changes nothing; the float64 lane sees the lost digits.
    """

    name = "float32_loss"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world), loss_dtype=torch.float32)
        return None


class LocalLoggedLoss:
    """Right gradients, but logs this rank's own token mean: the logged loss differs between ranks."""

    name = "local_logged_loss"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return local / max(sum(mb.supervised for mb in window), 1)


mean_of_local_means = MeanOfLocalMeans()
extra_microbatch_division = ExtraMicrobatchDivision()
no_world_size_factor = NoWorldSizeFactor()
skip_backward_when_empty = SkipBackwardWhenEmpty()
never_no_sync = NeverNoSync()
float32_loss = Float32Loss()
local_logged_loss = LocalLoggedLoss()

NEGATIVE_CONTROLS = (
    "mean_of_local_means",
    "extra_microbatch_division",
    "no_world_size_factor",
    "skip_backward_when_empty",
    "never_no_sync",
    "float32_loss",
    "local_logged_loss",
)
"""Attribute names in this module of every negative control (``harness.recipes:<name>``)."""


class RecipeError(ValueError):
    """A ``--recipe`` path that cannot be imported or whose object does not satisfy the contract."""


def load_recipe(path: str) -> Recipe:
    """Resolve ``package.module:attr`` (an instance, or a zero-argument callable returning one) and check its shape."""
    import importlib

    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        msg = f"recipe={path!r} must look like 'package.module:attr' (for example harness.recipes:global_token_mean)"
        raise RecipeError(msg)
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        msg = f"recipe={path!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        raise RecipeError(msg) from exc
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            msg = f"recipe={path!r}: {module_name!r} has no attribute {attr!r}"
            raise RecipeError(msg)
        obj = getattr(obj, part)
    if not hasattr(obj, "backward_window") and callable(obj):
        try:
            obj = obj()
        except Exception as exc:
            msg = f"recipe={path!r}: calling {attr}() to build the recipe failed: {type(exc).__name__}: {exc}"
            raise RecipeError(msg) from exc
    if not callable(getattr(obj, "backward_window", None)):
        msg = (
            f"recipe={path!r}: {type(obj).__name__} has no backward_window(model, window) method; "
            "see the recipe contract in the README"
        )
        raise RecipeError(msg)
    if not isinstance(getattr(obj, "name", None), str):
        msg = f"recipe={path!r}: {type(obj).__name__} needs a `name` attribute (a str) for reports"
        raise RecipeError(msg)
    return obj  # type: ignore[return-value]
