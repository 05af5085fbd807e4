"""Argument checks shared by every layer, so that a bad value reads the same wherever it is refused."""

from __future__ import annotations

import numbers


def positive_int(name: str, value: object, meaning: str = "") -> int:
    """``value`` as an int when it is a positive integer (never a bool); else ValueError naming ``name``, the value
    and, when given, what the number means."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        msg = f"{name}={value!r} must be a positive integer" + (f" ({meaning})" if meaning else "")
        raise ValueError(msg)
    return int(value)
