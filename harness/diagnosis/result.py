"""The diagnosis of one window's gradient, as a result: what was read (the signature, the fitted weight of every
block, the per-parameter view) and its renderings (the one line a failing verdict carries, the weight and parameter
tables, the JSON of the battery report). :func:`harness.diagnosis.diagnose.diagnose` computes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.diagnosis.fit import EXPLAINED_RESIDUAL, FLOAT32_RESIDUAL, MATCH_TOLERANCE, ROUNDING_RESIDUAL, Block
from harness.diagnosis.parameter_view import ParameterRow
from harness.diagnosis.signatures import Signature


@dataclass(frozen=True)
class Diagnosis:
    """What one window's gradient optimized, read off the numbers."""

    recipe: str
    scenario: str
    world_size: int
    precision: str
    window: int
    rank: int
    signature: Signature
    blocks: tuple[Block, ...]
    weights: tuple[float, ...]
    """Fitted weight per block (NaN for a block without a token)."""
    residual: float
    condition: float
    parameters: tuple[ParameterRow, ...]
    location: str
    sequence_signature: Signature | None = None
    sequence_residual: float | None = None
    objective: str = "token_mean"
    """The declared objective the weights are read against."""
    normalizer: float | None = None
    """Its ``Z`` over the window: every block's right weight is ``1/Z`` (None: the token mean's N)."""
    auxiliary_weights: tuple[float, ...] = ()
    """The auxiliary term's fitted weight per block, where the recipe declares one."""
    fits: tuple[tuple[str, float, float], ...] = ()
    """Each catalog pattern's ``(name, scale c, deviation)`` against the fitted weights, under the token mean: what
    the recipe-level reading weighs this case's weights against (:mod:`harness.diagnosis.recipe_level`)."""
    clipped: bool = False
    """Whether the reference's clip engaged on this window (its gradient was scaled by max_norm over its norm)."""
    fix: str | None = None
    """What to change in the recipe, in the words of its strategy, objective and mesh
    (:func:`harness.diagnosis.fixes.fix_for`; :func:`harness.diagnosis.diagnose.diagnose` sets it)."""

    @property
    def tokens(self) -> int:
        return sum(b.tokens for b in self.blocks)

    @property
    def z(self) -> float:
        """The right weight's inverse: the objective's normalizer (the supervised count under the token mean)."""
        return float(self.tokens) if self.normalizer is None else self.normalizer

    @property
    def right(self) -> bool:
        return self.signature.name == "correct"

    def ratios(self) -> list[float]:
        """Each block's weight over the right one (``weight * Z``; Z = N under the token mean)."""
        return [w * self.z for w in self.weights]

    def line(self) -> str:
        """The one-line diagnosis a failing verdict carries."""
        text = f"diagnosis ({self.signature.name}): {self.signature.sentence}"
        if self.signature.alternatives:
            text += f" (these counts cannot tell it from {', '.join(self.signature.alternatives)})"
        if self.signature.name == "unexplained" and self.residual > EXPLAINED_RESIDUAL:
            text += f"; {self.location}"
        return text

    def weight_table(self) -> str:
        """Actual and expected weight per rank and microbatch, with their ratio."""
        n, z = self.tokens, self.z
        under = "" if self.normalizer is None else f", {self.objective} normalizer Z={z:g}"
        expected = "expected 1/N" if self.normalizer is None else "expected 1/Z"
        lines = [f"window {self.window}, rank {self.rank}'s gradient, N={n} supervised tokens{under} "
                 f"(fit residual {self.residual:.2e}, condition {self.condition:.3g})",
                 f"{'rank':>4} {'mb':>3} {'tokens':>7} {'weight':>12} {expected:>12} {'ratio':>9}"]
        for b, w in zip(self.blocks, self.weights):
            shown = "-" if math.isnan(w) else f"{w:.6e}"
            ratio = "-" if math.isnan(w) else f"{w * z:.6f}"
            lines.append(f"{b.rank:>4} {b.microbatch:>3} {b.tokens:>7} {shown:>12} {1 / z:>12.6e} {ratio:>9}")
        return "\n".join(lines)

    def parameter_lines(self) -> str:
        width = max(len(r.name) for r in self.parameters)
        shares = any(r.residual_share is not None for r in self.parameters)
        head = f"{'parameter':<{width}} {'components':>10} {'max abs err':>11} {'over tol':>8} {'ratio':>9}"
        lines = [head + (f" {'residual':>8}" if shares else "")]
        for r in self.parameters:
            share = "" if not shares else f" {'-' if r.residual_share is None else f'{r.residual_share:.1%}':>8}"
            if r.note:
                lines.append(f"{r.name:<{width}} {r.components:>10} {r.note}{share}")
            else:
                lines.append(f"{r.name:<{width}} {r.components:>10} {r.max_abs_error:>11.3e} {r.over_tolerance:>8} "
                             f"{r.ratio:>9.5g}{share}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready (a NaN or infinite number becomes None)."""
        out = _finite(self._fields())
        assert isinstance(out, dict)
        return out

    def _fields(self) -> dict[str, object]:
        n = self.tokens
        return {
            "signature": self.signature.name,
            "sentence": self.signature.sentence,
            "line": self.line(),
            "factor": self.signature.factor,
            "blocks_named": list(self.signature.blocks),
            "alternatives": list(self.signature.alternatives),
            "window": self.window,
            "rank": self.rank,
            "tokens": n,
            "residual": self.residual,
            "condition": self.condition,
            "thresholds": {"explained_residual": EXPLAINED_RESIDUAL,
                           "rounding_residual": ROUNDING_RESIDUAL.get(self.precision, FLOAT32_RESIDUAL),
                           "float32_residual": FLOAT32_RESIDUAL, "match_tolerance": MATCH_TOLERANCE},
            "weights": [
                {"rank": b.rank, "microbatch": b.microbatch, "tokens": b.tokens,
                 "weight": None if math.isnan(w) else w, "expected": 1 / self.z,
                 "ratio": None if math.isnan(w) else w * self.z}
                for b, w in zip(self.blocks, self.weights)
            ],
            "parameters": [r.__dict__ for r in self.parameters],
            "location": self.location,
            "sequence_signature": None if self.sequence_signature is None else self.sequence_signature.name,
            "sequence_residual": self.sequence_residual,
            "objective": self.objective,
            "objective_computed": self.signature.objective,
            "normalizer": self.z,
            "auxiliary_weights": list(self.auxiliary_weights),
            "fits": [list(f) for f in self.fits],
            "clipped": self.clipped,
            "fix": self.fix,
        }


def _finite(obj: object) -> object:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


__all__ = ["Diagnosis"]
