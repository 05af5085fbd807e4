"""Gradient comparison with ``torch.testing.assert_close`` semantics, and a report that says by how much.

Every parameter's gradient is flattened into one vector (a missing ``.grad`` counts as zeros, which is what the
optimizer would see), and each component must satisfy ``|got - ref| <= atol + rtol * |ref|``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn

# Seed 000's r1 tolerances. The DDP path sums in another order than the single-device path (per-rank partial
# sums, then an all-reduce), and float32 addition is not associative (the battery's correct recipe misses by
# 7.5e-9 to 1.3e-8: ``python -m harness battery``).
FLOAT32_TOLERANCE = (1e-6, 1e-4)
# float64 leaves about nine more decimal digits: summation-order noise there is ~1e-16 relative, so a strict lane can
# reject errors (a downcast to float32, a denominator off by one token in a huge window) that float32 cannot see.
FLOAT64_TOLERANCE = (1e-12, 1e-9)


PRECISIONS = {"fp32": torch.float32, "fp64": torch.float64}
"""The precisions the harness computes in, by the name configs and options use."""


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for gradients of this dtype."""
    if dtype == torch.float32:
        return FLOAT32_TOLERANCE
    if dtype == torch.float64:
        return FLOAT64_TOLERANCE
    msg = f"dtype={dtype} has no documented tolerance; use torch.float32 or torch.float64"
    raise ValueError(msg)


def flat_grad(model: nn.Module) -> torch.Tensor:
    """All parameter gradients in ``named_parameters`` order, one flat CPU vector (zeros where ``.grad`` is None)."""
    params = list(_unwrap(model).parameters())
    if not params:
        msg = "model has no parameters to compare"
        raise ValueError(msg)
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in params]
    return torch.cat(parts).cpu()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in _unwrap(model).parameters()]).cpu()


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


@dataclass(frozen=True)
class Comparison:
    """How a gradient vector compares with its reference."""

    components: int
    max_abs_error: float
    over_tolerance: int
    worst_ratio: float
    """``max |d| / (atol + rtol * |ref|)``: how many tolerances the worst component misses by (<= 1 passes)."""
    atol: float
    rtol: float

    @property
    def passed(self) -> bool:
        return self.over_tolerance == 0

    def summary(self) -> str:
        verdict = "within tolerance" if self.passed else f"{self.over_tolerance} components over tolerance"
        return (
            f"{self.components} components, max abs error {self.max_abs_error:.3e}, worst ratio "
            f"{self.worst_ratio:.3g} (atol={self.atol:g}, rtol={self.rtol:g}): {verdict}"
        )

    def to_dict(self) -> dict[str, float | int | bool]:
        return {**asdict(self), "passed": self.passed}


def compare(
    got: torch.Tensor, ref: torch.Tensor, *, atol: float | None = None, rtol: float | None = None
) -> Comparison:
    """Compare two flat vectors; tolerances default to :func:`tolerances` of ``ref``'s dtype."""
    for name, t in (("got", got), ("ref", ref)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            msg = f"{name} must be a floating-point tensor, got {type(t).__name__}"
            raise TypeError(msg)
    if got.shape != ref.shape:
        msg = f"got has shape {tuple(got.shape)} but ref has {tuple(ref.shape)}; compare the same model's gradients"
        raise ValueError(msg)
    d_atol, d_rtol = tolerances(ref.dtype)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    got, ref = got.detach().cpu().to(ref.dtype).reshape(-1), ref.detach().cpu().reshape(-1)
    diff = (got - ref).abs()
    allowed = atol + rtol * ref.abs()
    # NaN anywhere is a failure: a NaN difference compares False with everything, so count it explicitly.
    bad = ~(diff <= allowed)
    # A component with no difference misses by nothing, also where its tolerance is 0 (atol=0, ref=0: 0/0).
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / allowed)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, float("inf")), ratio)
    return Comparison(
        components=ref.numel(),
        max_abs_error=float(diff.nan_to_num(float("inf")).max()) if ref.numel() else 0.0,
        over_tolerance=int(bad.sum()),
        worst_ratio=float(ratio.max()) if ref.numel() else 0.0,
        atol=atol,
        rtol=rtol,
    )


def assert_gradients_close(got: torch.Tensor, ref: torch.Tensor, *, what: str = "gradient") -> Comparison:
    """Raise ``AssertionError`` with the report unless every component is within tolerance."""
    result = compare(got, ref)
    if not result.passed:
        raise AssertionError(f"{what}: {result.summary()}")
    return result


def max_abs_difference(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """Largest absolute difference over paired tensors (0.0 means bitwise-equal values)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            msg = f"tensors of shapes {tuple(x.shape)} and {tuple(y.shape)} cannot be compared"
            raise ValueError(msg)
        if x.numel():
            worst = max(worst, float((x.detach().cpu().double() - y.detach().cpu().double()).abs().max()))
    return worst
