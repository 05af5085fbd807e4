"""The diagnosis of a run's gradient: the effective weight of every rank's microbatch, the signature it matches, and
the per-parameter view (the math is :mod:`harness.core.diagnosis`).

The block gradients are computed in float64 on one device, at the weights the recipe started the window from (its
own, right or wrong, so windows after a wrong step are read on their own terms), through the run's own model and
loss convention (:meth:`harness.battery.runner.Run.loss_sum`). The fitted gradient is one rank's synchronized
gradient; the expected one is the block gradients weighted ``1/N``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.battery.runner import Run
from harness.core import diagnosis as dx
from harness.core.compare import compare, flat_grad, tolerances
from harness.core.microbatch import Microbatch


@dataclass(frozen=True)
class Diagnosis:
    """What one window's gradient optimized, read off the numbers."""

    recipe: str
    scenario: str
    world_size: int
    precision: str
    window: int
    rank: int
    signature: dx.Signature
    blocks: tuple[dx.Block, ...]
    weights: tuple[float, ...]
    """Fitted weight per block (NaN for a block without a token)."""
    residual: float
    condition: float
    parameters: tuple[dx.ParameterRow, ...]
    location: str
    sequence_signature: dx.Signature | None = None
    sequence_residual: float | None = None

    @property
    def tokens(self) -> int:
        return sum(b.tokens for b in self.blocks)

    @property
    def right(self) -> bool:
        return self.signature.name == "correct"

    def ratios(self) -> list[float]:
        """Each block's weight over the right one (``weight * N``)."""
        return [w * self.tokens for w in self.weights]

    def line(self) -> str:
        """The one-line diagnosis a failing verdict carries."""
        text = f"diagnosis ({self.signature.name}): {self.signature.sentence}"
        if self.signature.alternatives:
            text += f" (these counts cannot tell it from {', '.join(self.signature.alternatives)})"
        if self.signature.name == "unexplained" and self.residual > dx.EXPLAINED_RESIDUAL:
            text += f"; {self.location}"
        return text

    def weight_table(self) -> str:
        """Actual and expected weight per rank and microbatch, with their ratio."""
        n = self.tokens
        lines = [f"window {self.window}, rank {self.rank}'s gradient, N={n} supervised tokens "
                 f"(fit residual {self.residual:.2e}, condition {self.condition:.3g})",
                 f"{'rank':>4} {'mb':>3} {'tokens':>7} {'weight':>12} {'expected 1/N':>12} {'ratio':>9}"]
        for b, w in zip(self.blocks, self.weights):
            shown = "-" if math.isnan(w) else f"{w:.6e}"
            ratio = "-" if math.isnan(w) else f"{w * n:.6f}"
            lines.append(f"{b.rank:>4} {b.microbatch:>3} {b.tokens:>7} {shown:>12} {1 / n:>12.6e} {ratio:>9}")
        return "\n".join(lines)

    def parameter_lines(self) -> str:
        width = max(len(r.name) for r in self.parameters)
        lines = [f"{'parameter':<{width}} {'components':>10} {'max abs err':>11} {'over tol':>8} {'ratio':>9}"]
        lines += [f"{r.name:<{width}} {r.components:>10} {r.max_abs_error:>11.3e} {r.over_tolerance:>8} "
                  f"{r.ratio:>9.5g}" for r in self.parameters]
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
            "weights": [
                {"rank": b.rank, "microbatch": b.microbatch, "tokens": b.tokens,
                 "weight": None if math.isnan(w) else w, "expected": 1 / n,
                 "ratio": None if math.isnan(w) else w * n}
                for b, w in zip(self.blocks, self.weights)
            ],
            "parameters": [r.__dict__ for r in self.parameters],
            "location": self.location,
            "sequence_signature": None if self.sequence_signature is None else self.sequence_signature.name,
            "sequence_residual": self.sequence_residual,
        }


def _finite(obj: object) -> object:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def worst(run: Run) -> tuple[int, int] | None:
    """``(window, rank)`` whose gradient is furthest from the reference, in tolerance ratios (None: no gradient)."""
    if run.records is None:
        return None
    best: tuple[float, int, int] | None = None
    for k, ref in enumerate(run.references):
        if ref is None:
            continue
        for rank in range(run.world_size):
            if k >= len(run.records[rank]) or run.records[rank][k].grad is None:
                continue
            ratio = compare(run.records[rank][k].grad, ref.gradient).worst_ratio  # type: ignore[arg-type]
            if best is None or not ratio <= best[0]:
                best = (ratio, k, rank)
    return None if best is None else (best[1], best[2])


def _column(run: Run, model: torch.nn.Module, mb: Microbatch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    run.loss_sum(model, mb).backward()
    return flat_grad(model)


def diagnose(run: Run, window: int | None = None, rank: int | None = None,
             per_sequence: bool = False) -> Diagnosis | None:
    """Diagnose one window's gradient on one rank (default: the worst window and rank). None when the run left no
    gradient there (it failed, or the recipe refused the window).

    ``per_sequence`` also fits one weight per row; it is done anyway when the microbatch fit does not explain the
    gradient, to tell a mean per sequence from other damage.
    """
    if window is None or rank is None:
        picked = worst(run)
        if picked is None:
            return None
        window, rank = (picked[0] if window is None else window), (picked[1] if rank is None else rank)
    if run.records is None or window >= len(run.records[rank]):
        return None
    rec = run.records[rank][window]
    if rec.grad is None:
        return None
    from harness.battery.facts import rank_threads

    with rank_threads():
        return _diagnose(run, window, rank, per_sequence)


def _weights_edited(run: Run, window: int, rank: int) -> dx.Signature | None:
    """The recipe changed weights up to this window: its gradient is then not a weighting of the reference's blocks at
    the weights the step started from, whatever the fit reads."""
    assert run.records is not None
    for j, rec in enumerate(run.records[rank][: window + 1]):
        if rec.weights_changed:
            when = "during this window" if j == window else f"in window {j}"
            names = ", ".join(rec.weights_changed[:4]) + (" ..." if len(rec.weights_changed) > 4 else "")
            return dx.Signature("weights_edited", f"the recipe changed the weights itself {when} ({names}, by up to "
                                f"{rec.weights_touched:.3e}): an in-place weight decay or step inside backward_window; "
                                "the gradient is not read as a weighting (weights_unchanged names the change)")
    return None


def _diagnose(run: Run, window: int, rank: int, per_sequence: bool) -> Diagnosis | None:
    assert run.records is not None
    rec = run.records[rank][window]
    assert rec.grad is not None
    g = rec.grad.double()
    model = run.model_at(rec.params_before, torch.float64)
    model.train()
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    blocks, columns = [], []
    zero = torch.zeros(sum(sizes), dtype=torch.float64)
    for r, mbs in enumerate(run.windows[window]):
        for m, mb in enumerate(mbs):
            blocks.append(dx.Block(r, m, mb.supervised))
            columns.append(_column(run, model, mb) if mb.supervised else zero)
    a = torch.stack(columns, dim=1)
    n = sum(b.tokens for b in blocks)
    expected = a.sum(dim=1) / n
    atol, rtol = tolerances(torch.float32 if run.precision == "fp32" else torch.float64)
    params = dx.parameter_table(g, expected, names, sizes, atol, rtol)
    location = dx.locate(params)
    common = dict(recipe=run.recipe, scenario=run.scenario, world_size=run.world_size, precision=run.precision,
                  window=window, rank=rank, blocks=tuple(blocks), parameters=tuple(params), location=location)
    if not bool(torch.isfinite(g).all()):
        bad = int((~torch.isfinite(g)).sum())
        sig = dx.Signature("nonfinite", f"rank {rank}'s synchronized gradient holds NaN or inf in {bad} of "
                           f"{g.numel()} components: a division by a zero count (an empty rank or microbatch) reached "
                           "the loss; skip the division when the count is zero, or use a masked sum")
        nan = tuple(math.nan for _ in blocks)
        return Diagnosis(signature=sig, weights=nan, residual=math.nan, condition=math.nan, **common)  # type: ignore[arg-type]
    fit = dx.fit_weights(a, g)
    others = {f"window {j}'s global count": sum(mb.supervised for mbs in w for mb in mbs)
              for j, w in enumerate(run.windows) if j != window}
    sig = dx.classify(blocks, fit, run.world_size, run.precision, rank=rank, other_counts=others)
    edited = _weights_edited(run, window, rank)
    if edited is not None:
        sig = edited
    seq_sig, seq_resid = None, None
    if per_sequence or sig.name == "unexplained":
        rows, cols = [], []
        for r, mbs in enumerate(run.windows[window]):
            for m, mb in enumerate(mbs):
                for i in range(mb.inputs.shape[0]):
                    row = Microbatch(mb.inputs[i : i + 1], mb.labels[i : i + 1])
                    rows.append(dx.Block(r, m, row.supervised, row=i))
                    cols.append(_column(run, model, row) if row.supervised else zero)
        seq_fit = dx.fit_weights(torch.stack(cols, dim=1), g)
        seq_resid = seq_fit.residual
        seq_sig = dx.classify_sequences(rows, seq_fit)
        if seq_sig is not None and sig.name == "unexplained":
            sig = seq_sig
    return Diagnosis(signature=sig, weights=tuple(float(w) for w in fit.weights), residual=fit.residual,
                     condition=fit.condition, sequence_signature=seq_sig, sequence_residual=seq_resid,
                     **common)  # type: ignore[arg-type]


__all__ = ["Diagnosis", "diagnose", "worst"]
