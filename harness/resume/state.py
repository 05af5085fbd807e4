"""Training state as plain data: CPU copies of nested states, and the bitwise distance between two of them.

The resume tests compare a resumed run with a continuous one through :func:`state_difference`: 0.0 means equal bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def cpu_copy(obj: Any) -> Any:
    """A detached CPU copy of every tensor in a nested state (dicts, lists, tuples); other leaves as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()  # a loop may go on writing into the array it returned
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple takes its fields one by one
        return type(obj)(*(cpu_copy(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def state_difference(a: Any, b: Any) -> float:
    """Largest absolute difference between two nested states (dicts, lists, tensors, numbers); 0.0 means equal bits.

    A difference in structure or in a non-numeric leaf counts as ``inf``: it is never "close".
    """
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        if not a.numel():
            return 0.0
        if not a.is_floating_point():
            return 0.0 if torch.equal(a.cpu(), b.cpu()) else float("inf")
        return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max())
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return float("inf")
        return max((state_difference(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return float("inf")
        return max((state_difference(x, y) for x, y in zip(a, b)), default=0.0)
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        if a == b:
            return 0.0
        return abs(float(a) - float(b)) if a == a and b == b else float("inf")  # NaN is never equal
    return 0.0 if a == b else float("inf")


__all__ = ["cpu_copy", "state_difference"]
