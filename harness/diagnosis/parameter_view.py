"""The per-parameter view of a gradient's error: each parameter tensor's error and its ratio to the expected
gradient, each tensor's share of a fit's residual, and one sentence on where the error lies.

When the fit (:func:`harness.diagnosis.fit.fit_weights`) leaves a large residual the mistake is not a re-weighting;
:func:`parameter_table` then says which parameter tensors carry the error and by what ratio, :func:`residual_shares`
which carry the residual, and :func:`locate` says it in words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.diagnosis.fit import match_tolerance


@dataclass(frozen=True)
class ParameterRow:
    name: str
    components: int
    max_abs_error: float
    over_tolerance: int
    ratio: float
    """``<g_p, e_p> / <e_p, e_p>``: the scale of this tensor's gradient against the expected one (1 when right)."""
    note: str = ""
    """``"no gradient"`` (zero where the reference's is not), ``"no gradient (none expected)"`` (both zero)."""
    residual_share: float | None = None
    """This tensor's share of the fit residual's squared norm (where an extra term lives), when computed."""

    def shown(self) -> str:
        """The row's reading in words: its note, else its ratio."""
        return self.note or f"ratio {self.ratio:.4g}"


def parameter_table(got: torch.Tensor, expected: torch.Tensor, names: Sequence[str], sizes: Sequence[int],
                    atol: float, rtol: float) -> list[ParameterRow]:
    """Per parameter tensor (model order, ``got`` and ``expected`` flat): its error, components over tolerance and
    its ratio to the expected gradient."""
    rows, offset = [], 0
    for name, n in zip(names, sizes):
        a, e = got[offset : offset + n].double(), expected[offset : offset + n].double()
        offset += n
        diff = (a - e).abs()
        denom = float(e.dot(e))
        got_zero = not n or float(a.abs().max()) == 0
        ratio = float(a.dot(e)) / denom if denom > 0 else (1.0 if got_zero else math.inf)
        note = ("no gradient (none expected)" if denom == 0 else "no gradient") if got_zero else ""
        rows.append(ParameterRow(name, n, float(diff.max()) if n else 0.0,
                                 int((~(diff <= atol + rtol * e.abs())).sum()), ratio, note))
    return rows


def residual_shares(residual: torch.Tensor, names: Sequence[str], sizes: Sequence[int]) -> list[tuple[str, float]]:
    """Each tensor's share of ``|residual|^2`` (model order)."""
    total = float(residual.double().pow(2).sum())
    out, offset = [], 0
    for name, n in zip(names, sizes):
        part = float(residual[offset : offset + n].double().pow(2).sum())
        offset += n
        out.append((name, part / total if total > 0 else 0.0))
    return out


def locate(rows: Sequence[ParameterRow]) -> str:
    """One sentence on where a non-re-weighting error lives, from :func:`parameter_table`."""
    bad = [r for r in rows if r.over_tolerance]
    if not bad:
        return "every parameter tensor is within tolerance"
    live = [r for r in rows if r.note != "no gradient (none expected)"]
    if live and all(abs(r.ratio - 1) <= match_tolerance() for r in live):
        return (f"{len(bad)} of {len(rows)} parameter tensors are over tolerance, every one at ratio 1 (within "
                f"{match_tolerance():g}): noise spread over every component, not a scale: a lower precision somewhere")
    if len(bad) == len(rows):
        ratios = [r.ratio for r in bad]
        if max(ratios) - min(ratios) <= match_tolerance() * max(abs(x) for x in ratios):
            return f"every parameter tensor is off by the same ratio {ratios[0]:.4g}: a scale on the whole gradient"
    worst = sorted(bad, key=lambda r: -r.max_abs_error)
    listed = ", ".join(f"{r.name} ({r.shown()}, {r.over_tolerance} of {r.components} over)" for r in worst[:4])
    more = f" and {len(worst) - 4} more" if len(worst) > 4 else ""
    return f"{len(bad)} of {len(rows)} parameter tensors are off: {listed}{more}"


__all__ = ["ParameterRow", "locate", "parameter_table", "residual_shares"]
