"""The audit's options that the command line checks before any process starts (pure Python: no torch)."""

from __future__ import annotations

from harness.core.objective_names import FIXED_NORMALIZER, SEQUENCE_MEAN, TOKEN_MEAN

LABELS_HELP = ("where the labels are: auto (default: a labels= keyword in the Hugging Face convention, unshifted, -100 "
               "ignored; else a targets= keyword or the model's second argument, aligned, every negative ignored), hf, "
               "aligned, or PKG.MODULE:FN, a function of a call's (args, kwargs) returning the aligned labels [B, T]")
LABEL_MODES = ("auto", "hf", "aligned")


def objective_parts(name: str) -> tuple[str, float | None]:
    """``token_mean``, ``sequence_mean`` or ``fixed_normalizer=C`` as (objective, constant). ValueError naming the
    choices."""
    base, _, constant = name.partition("=")
    value = None
    if base == FIXED_NORMALIZER and constant:
        try:
            value = float(constant)
        except ValueError:
            value = None
        if value is not None and not value > 0:
            value = None
    if (base, value is not None) not in ((TOKEN_MEAN, False), (SEQUENCE_MEAN, False), (FIXED_NORMALIZER, True)) or (
            base != FIXED_NORMALIZER and constant):
        msg = (f"--objective {name!r}: the audit judges token_mean (default), sequence_mean or fixed_normalizer=C "
               "(C > 0, the constant the loss sum is divided by)")
        raise ValueError(msg)
    return base, value


def check_labels(labels: str) -> str:
    """``labels`` if it is one of :data:`LABEL_MODES` or ``PKG.MODULE:FN``; ValueError naming the choices."""
    module, colon, fn = labels.partition(":")
    if labels in LABEL_MODES or (colon and module and fn):
        return labels
    msg = f"--labels {labels!r}: give auto, hf, aligned or PKG.MODULE:FN"
    raise ValueError(msg)


__all__ = ["LABELS_HELP", "LABEL_MODES", "check_labels", "objective_parts"]
