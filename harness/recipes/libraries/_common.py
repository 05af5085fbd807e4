"""What the library recipes share: the window's counts, the ``no_sync()`` decision, a float all-reduce, and the error
a recipe raises when its library is not installed."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from harness.core.loss import count_device
from harness.core.microbatch import Microbatch

EXTRA_HINT = "needs the integrations extra: pip install .[integrations]"
"""The skip reason of the integrations lane, and the message of a library recipe run without its library."""

TORCHTITAN_HINT = ("needs torchtitan, which the extra cannot install without replacing packages: "
                   "bash scripts/integrations.sh installs it with --no-deps")


def missing(library: str, hint: str = EXTRA_HINT) -> ImportError:
    """The error ``setup()`` raises on a rank when the recipe's library could not be imported."""
    return ImportError(f"{library} is not installed; this recipe {hint}")


def local_count(window: Sequence[Microbatch]) -> int:
    """This rank's supervised tokens in the window."""
    return sum(mb.supervised for mb in window)


def all_reduce_sum(value: float | int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``value`` summed over the ranks (the identity without a process group), as a 0-d tensor."""
    t = torch.tensor(value, dtype=dtype, device=count_device() if dist.is_initialized() else "cpu")
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def sync_last(model: nn.Module, i: int, n: int) -> contextlib.AbstractContextManager[object]:
    """``model.no_sync()`` around microbatch ``i`` unless it is the window's last (forward and backward inside)."""
    return contextlib.nullcontext() if i == n - 1 else model.no_sync()  # type: ignore[operator]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
