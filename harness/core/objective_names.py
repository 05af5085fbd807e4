"""The declared objectives' names and their validation, in pure Python: the battery's options (which the pytest plugin
parses without importing torch) and :mod:`harness.core.objectives` (which holds the formulas) share them."""

from __future__ import annotations

TOKEN_MEAN = "token_mean"
SEQUENCE_MEAN = "sequence_mean"
WEIGHTED_TOKEN_MEAN = "weighted_token_mean"
FIXED_NORMALIZER = "fixed_normalizer"
LABEL_SMOOTHING = "label_smoothing"
ENTROPY_BONUS = "entropy_bonus"
OBJECTIVES = (TOKEN_MEAN, SEQUENCE_MEAN, WEIGHTED_TOKEN_MEAN, FIXED_NORMALIZER, LABEL_SMOOTHING, ENTROPY_BONUS)
"""``--objective`` values; the first is the default."""


def check_objective(value: object, option: str = "--objective") -> str:
    """``value`` if it names an objective; ValueError naming the option, the value and the choices otherwise."""
    if value not in OBJECTIVES:
        msg = (f"{option}={value!r} must be one of {', '.join(OBJECTIVES)} (token_mean, the default, is the mean over "
               "every supervised token of the global window; docs/objectives.md says what each one computes)")
        raise ValueError(msg)
    return str(value)


__all__ = ["ENTROPY_BONUS", "FIXED_NORMALIZER", "LABEL_SMOOTHING", "OBJECTIVES", "SEQUENCE_MEAN", "TOKEN_MEAN",
           "WEIGHTED_TOKEN_MEAN", "check_objective"]
