"""Correct recipes written in other shapes than ``harness.recipes.GlobalTokenMean``: the battery must pass each."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100


def _count(window: Sequence[Any], group: Any = None) -> int:
    local = sum(int((mb.labels != IGNORE).sum()) for mb in window)
    if not dist.is_initialized():
        return local
    t = torch.tensor([local], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item())


def _accumulate(model: torch.nn.Module, window: Sequence[Any], total: int, *, no_sync_on_one_process: bool = True,
                float32: bool = False) -> None:
    """Sum losses scaled by W / N, every microbatch but the last under no_sync() (unless told to skip no_sync() when
    there is one process), optionally computing the loss in float32."""
    world = dist.get_world_size()
    if total == 0:
        raise ValueError("no supervised token in this window on any rank")
    for i, mb in enumerate(window):
        skip_sync = i < len(window) - 1 and (no_sync_on_one_process or world > 1)
        with model.no_sync() if skip_sync else contextlib.nullcontext():  # type: ignore[operator]
            logits = model(mb.inputs)
            logits = logits.float() if float32 else logits
            s = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE, reduction="sum")
            (s * world / total).backward()


class ClassRecipe:
    """Given to the battery as the class itself (``--recipe=user_recipes.variants:ClassRecipe``)."""

    name = "class_recipe"

    def __init__(self) -> None:
        self.windows_seen = 0

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> float:
        self.windows_seen += 1
        world = dist.get_world_size()
        total = _count(window)
        if total == 0:
            raise ValueError("no supervised token in this window on any rank")
        local_sum = 0.0
        for i, mb in enumerate(window):
            ctx = model.no_sync() if i < len(window) - 1 else contextlib.nullcontext()  # type: ignore[operator]
            with ctx:
                logits = model(mb.inputs)
                s = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb.labels.reshape(-1), ignore_index=IGNORE,
                                    reduction="sum")
                (s * world / total).backward()
            local_sum += s.item()
        t = torch.tensor([local_sum], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / total


def make_recipe() -> ClassRecipe:
    """A zero-argument factory (``--recipe=user_recipes.variants:make_recipe``)."""
    recipe = ClassRecipe()
    recipe.name = "factory_recipe"
    return recipe


class SkipsNoSyncOnOneProcess:
    """Like accelerate: with a single process there is nothing to synchronize, so it never enters ``no_sync()``."""

    name = "skips_no_sync_on_one_process"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        _accumulate(model, window, _count(window), no_sync_on_one_process=False)


class Float32Loss:
    """Computes the loss in float32 on purpose, as transformers and torchtitan do (``logits.float()``): right in the
    float32 lane; the float64 lane names the float32 computation."""

    name = "float32_loss_on_purpose"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        _accumulate(model, window, _count(window), float32=True)


class CountsOnItsOwnGroup:
    """Builds a process group of its own in ``setup()`` (inside the process group, before the first window) and
    counts tokens over it."""

    name = "counts_on_its_own_group"

    def __init__(self) -> None:
        self.group: Any = None

    def setup(self) -> None:
        self.group = dist.new_group(backend="gloo")

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        if self.group is None:
            raise RuntimeError("setup() was not called before the first window")
        _accumulate(model, window, _count(window, self.group))


class SetsItsThreadCount(SkipsNoSyncOnOneProcess):
    """Right numbers, but sets torch's thread count: a note in the hygiene verdict, never a failure."""

    name = "sets_its_thread_count"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        torch.set_num_threads(torch.get_num_threads() + 1)
        return super().backward_window(model, window)


class RaisesOnEveryRank:
    """A factory that fails: the loader must say so before any rank starts."""

    name = "never_built"

    def __init__(self) -> None:
        raise RuntimeError("needs a config file that is not there")
