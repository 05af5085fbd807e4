"""The least-squares fit of a gradient's block weights, and the tolerances its readings are judged at.

A synchronized gradient is linear in the per-token losses, so every normalization mistake is a *re-weighting*: the
recipe's gradient ``g`` is ``sum over blocks b of w[b] * G[b]``, where a block is one rank's microbatch (or one
sequence of it) and ``G[b]`` the single-device gradient of that block's loss *sum*. The global token mean has every
``w[b] = 1/N``. :func:`fit_weights` solves for ``w`` by least squares (a few dozen unknowns against every gradient
component); :mod:`harness.diagnosis.signatures` reads the weights against its catalog.

The tolerances say how closely the fitted weights are read: a match to a pattern, a weight called exact, a residual
explained or left by rounding, a condition number past which the weights are not read at all. Inside
:func:`accuracy` each is at least a gradient's own stated error (the bf16 lane). ``tests/unit/test_diagnosis.py``
recovers drawn weight patterns through the fit.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

MATCH_TOLERANCE = 1e-4
"""Largest relative deviation between fitted ratios and a signature's pattern (or a named factor) for it to match.
Fitted from float32 gradients, the right recipe's ratios sit within 3e-7 of 1 (``max_ratio_error`` in
``benchmarks/results/diagnosis.json``); distinct signatures on real counts differ by percents, but a count can come
within a tenth of a percent of a named factor by chance (N / (W * max count) = 0.4996 on one battery window), so
the bound stays near the fit's accuracy, not near the signatures' spacing."""

EXACT_TOLERANCE = {"fp32": 1e-5, "fp64": 1e-9}
"""Largest ``|ratio - 1|`` still called right, by the precision of the gradient that was fitted."""

EXPLAINED_RESIDUAL = 1e-4
"""Largest relative residual ``|G w - g| / |g|`` of a fit that explains ``g`` as a re-weighting."""

MAX_CONDITION = 1e6
"""Largest condition number of the block gradients for which the fitted weights are read at all: past it, float32
rounding of ``g`` alone moves the weights by more than :data:`MATCH_TOLERANCE`."""

FLOAT64_RESIDUAL = 1e-10
"""A float64 gradient's residual above this, with the right weights, is no longer float64 rounding (the right float64
recipe leaves about 1e-15)."""

FLOAT32_RESIDUAL = 1e-6
"""Largest fit residual read as float32 rounding (a float32 run's gradient, or float32 arithmetic in a float64 run).
Measured: the ``float32_loss`` control on its target (``uneven``, fp64) leaves 1.5e-8 at W=2 and 1.7e-8 at W=3, and the
right recipe's float32 gradients stay under 1e-6 (``test_the_right_weights_are_recovered_within_1e_5...``); the bound
sits about 60x above the float32 rounding measured, and 20x below an auxiliary term's 2e-5 that must not be called
rounding. Above it, right weights with a residual are an extra term
(:data:`harness.diagnosis.signatures.SIGNATURES` ``extra_term``)."""

ROUNDING_RESIDUAL = {"fp32": FLOAT32_RESIDUAL, "fp64": FLOAT64_RESIDUAL}
"""The residual a gradient of each precision may carry from rounding alone, the rest being explained."""

_ACCURACY: contextvars.ContextVar[float | None] = contextvars.ContextVar("diagnosis_accuracy", default=None)


@contextlib.contextmanager
def accuracy(relative: float) -> Iterator[None]:
    """Read gradients whose own error is up to ``relative`` (a relative L2): the bf16 lane's bound. Inside, every
    match, exactness and residual threshold is at least ``relative``: the weights are read to that accuracy, and
    signatures closer than it are not told apart."""
    token = _ACCURACY.set(relative)
    try:
        yield
    finally:
        _ACCURACY.reset(token)


def _floor(value: float) -> float:
    stated = _ACCURACY.get()
    return value if stated is None else max(value, stated)


def match_tolerance() -> float:
    """:data:`MATCH_TOLERANCE`, or the stated accuracy inside :func:`accuracy`."""
    return _floor(MATCH_TOLERANCE)


def explained_residual() -> float:
    """:data:`EXPLAINED_RESIDUAL`, or the stated accuracy inside :func:`accuracy`."""
    return _floor(EXPLAINED_RESIDUAL)


def exact_tolerance(precision: str) -> float:
    return _floor(EXACT_TOLERANCE.get(precision, EXACT_TOLERANCE["fp32"]))


def rounding_residual(precision: str) -> float:
    return _floor(ROUNDING_RESIDUAL.get(precision, FLOAT32_RESIDUAL))


@dataclass(frozen=True)
class Block:
    """One unknown of the fit: rank ``rank``'s microbatch ``microbatch`` (its row ``row`` when fitting sequences)."""

    rank: int
    microbatch: int
    tokens: int
    row: int | None = None
    rows: int = 0
    """The block's rows (sequences): a count one token per row off is named as such (0: unknown)."""
    real: int = 0
    """The block's real (non-padding) positions, prompt included: what a count of an attention mask gives (0:
    unknown)."""
    holder: str | None = None
    """Who holds the block where ``rank`` alone would not say it (on a mesh: ``"rank 1 (dp 0, cp 1)"``); ``rank`` is
    then its index among the mesh's token ranks (:meth:`harness.core.mesh.Mesh.token_rank`)."""

    def label(self) -> str:
        where = f"{self.holder or f'rank {self.rank}'}'s microbatch {self.microbatch}"
        return where if self.row is None else f"{where}, row {self.row}"


@dataclass(frozen=True)
class Fit:
    weights: torch.Tensor
    """One weight per block (float64); NaN where the block holds no token (its gradient is zero: no information)."""
    residual: float
    """``|G w - g| / |g|``: 0 when ``g`` is exactly a re-weighting of the blocks."""
    condition: float
    """Condition number of the column-normalized block gradients (how well the blocks are told apart)."""


def fit_weights(columns: torch.Tensor, g: torch.Tensor) -> Fit:
    """Least-squares weights ``w`` with ``columns @ w ~ g``; ``columns`` is ``[components, blocks]``.

    Columns are normalized before solving (block gradients differ in scale by their token counts) and all-zero
    columns (blocks without a token) are left out with a NaN weight.
    """
    if columns.dim() != 2 or g.dim() != 1 or columns.shape[0] != g.shape[0]:
        msg = f"columns {tuple(columns.shape)} and g {tuple(g.shape)} must be [D, K] and [D]"
        raise ValueError(msg)
    a, b = columns.double(), g.double()
    norms = a.norm(dim=0)
    live = norms > 0
    weights = torch.full((a.shape[1],), math.nan, dtype=torch.float64)
    gnorm = float(b.norm())
    if not bool(live.any()):
        return Fit(weights, 1.0 if gnorm > 0 else 0.0, math.inf)
    scaled = a[:, live] / norms[live]
    solution = torch.linalg.lstsq(scaled, b.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    weights[live] = solution / norms[live]
    resid = float((scaled @ solution - b).norm())
    singular = torch.linalg.svdvals(scaled)
    condition = float(singular[0] / singular[-1]) if float(singular[-1]) > 0 else math.inf
    return Fit(weights, resid / gnorm if gnorm > 0 else resid, condition)


__all__ = [
    "EXACT_TOLERANCE",
    "EXPLAINED_RESIDUAL",
    "FLOAT32_RESIDUAL",
    "FLOAT64_RESIDUAL",
    "MATCH_TOLERANCE",
    "MAX_CONDITION",
    "ROUNDING_RESIDUAL",
    "Block",
    "Fit",
    "accuracy",
    "exact_tolerance",
    "explained_residual",
    "fit_weights",
    "match_tolerance",
    "rounding_residual",
]
