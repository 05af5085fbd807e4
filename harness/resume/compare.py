"""Where two training states first differ: a path into the nested state
(``['optimizer']['state'][3]['momentum_buffer']``) and what differs there. Bitwise: a tensor or a numpy array
matches only with the same dtype, shape and bytes (NaN included); a numpy scalar only with the same type and bytes.

The values compared are those :func:`harness.resume.contract.check_state` admits; it refuses anything else before a
run compares it, so an ``==`` that answers with an array (or anything but a bool) never reaches this module."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    x, y = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    if torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
        return None
    if x.is_floating_point():
        worst = float((x.double() - y.double()).abs().nan_to_num(math.inf).max())
        return f"max abs difference {worst:.3e} over {x.numel()} elements"
    return f"{int((x != y).sum())} of {x.numel()} elements differ"


def _numpy_difference(a: Any, b: Any, where: str) -> tuple[str, str] | None:
    if type(a) is not type(b):
        return where, f"{type(a).__name__} vs {type(b).__name__}"
    x, y = np.asarray(a), np.asarray(b)
    if x.dtype != y.dtype or x.shape != y.shape:
        return where, f"numpy {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
    if x.tobytes() == y.tobytes():
        return None
    if x.dtype.kind in "fc":
        gap = np.abs(x.astype(np.complex128) - y.astype(np.complex128))
        gap[np.isnan(x) & np.isnan(y)] = 0.0  # NaN where both are NaN is no difference
        worst = float(np.nan_to_num(gap, nan=np.inf).max())
        return where, f"max abs difference {worst:.3e} over {x.size} elements (numpy)"
    return where, f"{int((x != y).sum())} of {x.size} elements differ (numpy)"


def first_difference(expected: Any, got: Any, path: str = "") -> tuple[str, str] | None:
    """``(path, what)`` of the first leaf where ``got`` differs from ``expected``; None when they are bitwise equal."""
    where = path or "(top)"
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)):
            return where, f"{type(expected).__name__} vs {type(got).__name__}"
        what = _tensor_difference(expected, got)
        return None if what is None else (where, what)
    if isinstance(expected, (np.ndarray, np.generic)) or isinstance(got, (np.ndarray, np.generic)):
        return _numpy_difference(expected, got, where)
    if isinstance(expected, Mapping) and isinstance(got, Mapping):
        keys_e, keys_g = list(expected), list(got)
        if set(keys_e) != set(keys_g):
            only_e = sorted(map(str, set(keys_e) - set(keys_g)))
            only_g = sorted(map(str, set(keys_g) - set(keys_e)))
            return where, f"keys differ: only in the continuous run {only_e}, only in this run {only_g}"
        for k in keys_e:
            found = first_difference(expected[k], got[k], f"{path}[{k!r}]")
            if found is not None:
                return found
        return None
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(expected) != len(got):
            return where, f"length {len(expected)} vs {len(got)}"
        for i, (x, y) in enumerate(zip(expected, got)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(expected, float) and isinstance(got, float) and math.isnan(expected) and math.isnan(got):
        return None
    if type(expected) is not type(got) and not (isinstance(expected, (int, float)) and isinstance(got, (int, float))
                                                and not isinstance(expected, bool) and not isinstance(got, bool)):
        return where, f"{expected!r} ({type(expected).__name__}) vs {got!r} ({type(got).__name__})"
    if expected != got:
        shown_e, shown_g = repr(expected), repr(got)
        if len(shown_e) > 60:
            shown_e, shown_g = shown_e[:60] + "...", shown_g[:60] + "..."
        return where, f"{shown_e} vs {shown_g}"
    return None


__all__ = ["first_difference"]
