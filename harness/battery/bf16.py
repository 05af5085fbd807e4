"""The bf16 lane (``--precision bf16``): a bound on the gradient's error the harness derives instead of hard-coding.

Fixed float32 tolerances cannot judge bfloat16 (8 bits of mantissa: the correct computation itself misses the float64
gradient by a relative L2 of a few 1e-3), and a loose fixed bound would pass a mistake on a window whose ranks hold
nearly the same number of tokens. So, for each run:

1. **The noise** (:func:`measure_noise`, before any rank starts): the correct computation, on one device, in the
   strategy's own bf16 mode (autocast for DDP; the parameters cast to bf16 for FSDP2's ``MixedPrecisionPolicy``),
   against the float64 gradient, on the run's windows, from the initial weights of :data:`NOISE_SEEDS` seeds. The
   noise is the largest relative L2 error seen.
2. **The bound** is :data:`NOISE_MULTIPLE` times the noise.
3. **The windows it can judge** (:func:`read_windows`): at the weights a rank started a window from, the float64
   gradient of the declared objective is the truth, and the mean of local means (each rank's own normalization, a
   rank without tokens contributing zero, over W: the mistake every re-weighting of ranks resembles) must stand at
   least :data:`SEPARATION` times the bound away from it; a window too balanced for that is refused, and the verdict
   says so. If every window is refused the check does not apply.
4. The recipe's error on each judged window, as a relative L2 against the truth, is held to the bound; the verdict
   prints the noise, the bound, the error and their ratio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from harness.core.reference import reference_gradient

if TYPE_CHECKING:
    from harness.battery.runner import Run
    from harness.battery.spec import ModelSpec
    from harness.core.microbatch import Microbatch

NOISE_SEEDS = 3
"""Initial weights the noise is measured from: the run's seed and the next ones."""

NOISE_MULTIPLE = 4.0
"""The bound is this multiple of the measured noise. Measured (``benchmarks/results/fsdp2_bf16.json``, W=2 and 3,
DDP and FSDP2): the correct recipe's error on the ranks is 0.19-0.23 of the bound (at most the noise itself), a mean
of local means 8.6-19x above it."""

SEPARATION = 2.0
"""A window is judged only where the mean of local means misses the truth by at least this multiple of the bound."""

MODES = {"ddp": "autocast", "fsdp2": "params"}
"""How each strategy computes in bf16: DDP under ``torch.autocast`` (float32 weights); FSDP2's policy casts the
parameters to bf16 for the forward and backward and reduces in float32."""


@dataclass(frozen=True)
class Noise:
    """The correct computation's own bf16 error, and the bound derived from it."""

    noise: float
    """The largest relative L2 error of the bf16 gradient against float64 over the seeds and windows."""
    samples: tuple[float, ...]
    """Each seed's largest error."""
    mode: str
    """``"autocast"`` or ``"params"`` (:data:`MODES`)."""

    @property
    def bound(self) -> float:
        return NOISE_MULTIPLE * self.noise

    def describe(self) -> str:
        return (f"the correct computation's own bf16 noise is {self.noise:.2e} (relative L2 against float64, on one "
                f"device, {self.mode}, over {len(self.samples)} seeds), the bound {NOISE_MULTIPLE:g}x that: "
                f"{self.bound:.2e}")


LossOf = Callable[[torch.nn.Module, "Microbatch"], torch.Tensor]


def _gradient(model: torch.nn.Module, window: Sequence[Sequence[Microbatch]], gradient_of: Callable[..., torch.Tensor],
              mode: str | None) -> torch.Tensor:
    """The flat gradient of ``window`` (``gradient_of(model, window)``) in float64, computed in ``mode``: None
    (the model as it is), ``"autocast"`` or ``"params"`` (a bf16 copy of the model)."""
    if mode == "params":
        return gradient_of(_copy(model).to(torch.bfloat16), window).double()
    if mode == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return gradient_of(model, window).double()
    return gradient_of(model, window).double()


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


def relative_l2(got: torch.Tensor, truth: torch.Tensor) -> float:
    norm = float(truth.double().norm())
    return float((got.double() - truth.double()).norm()) / norm if norm > 0 else float("inf")


def measure_noise(spec: ModelSpec, windows: Sequence[Sequence[Sequence[Microbatch]]], strategy: str,
                  gradient_of: Callable[[ModelSpec], Callable[..., torch.Tensor]]) -> Noise:
    """:class:`Noise` of ``spec``'s model on ``windows`` in ``strategy``'s bf16 mode. ``gradient_of(spec)`` gives
    ``f(model, window) -> flat gradient`` of the declared objective under ``spec``'s batch convention."""
    from harness.battery.facts import rank_threads
    from harness.battery.start import load, start_weights

    mode = MODES.get(strategy, "autocast")
    samples = []
    with rank_threads():
        for i in range(NOISE_SEEDS):
            worst = 0.0
            seeded = replace(spec, init_seed=spec.seed + i, digest=None)
            fp64 = replace(seeded, precision="fp64")
            for window in windows:
                if sum(mb.supervised for rank in window for mb in rank) == 0:
                    continue
                # At the weights the lane's runs start from (harness.battery.start): float32's, the truth cast.
                start = start_weights(replace(seeded, precision="fp32"))
                truth = _gradient(load(fp64.build(), start), window, gradient_of(fp64), None)
                low = _gradient(load(replace(seeded, precision="fp32").build(), start), window, gradient_of(seeded),
                                mode)
                worst = max(worst, relative_l2(low, truth))
            samples.append(worst)
    return Noise(max(samples), tuple(samples), mode)


@dataclass(frozen=True)
class Window:
    """What the bf16 lane read on one window, at one rank's starting weights."""

    window: int
    rank: int
    error: float
    """The rank's gradient against the float64 truth (relative L2)."""
    mistake: float
    """The mean of local means against the same truth: how far the mistake this lane must see stands."""


def read_windows(run: Run, gradient_of: Callable[..., torch.Tensor]) -> list[Window]:
    """Each window's worst rank error and the mean of local means' distance, against the float64 gradient at the
    weights each rank started from (one truth per distinct starting point)."""
    from harness.battery.facts import rank_threads

    assert run.records is not None
    out = []
    with rank_threads():
        for k, window in enumerate(run.windows):
            if sum(mb.supervised for rank in window for mb in rank) == 0:
                continue
            truths: dict[bytes, tuple[torch.Tensor, float]] = {}
            worst: Window | None = None
            for rank, records in enumerate(run.records):
                if k >= len(records) or records[k].grad is None:
                    continue
                before = records[k].params_before
                key = before.numpy().tobytes()
                if key not in truths:
                    model = run.model_at(before, torch.float64)
                    truth = gradient_of(model, window).double()
                    # Each rank's own mean, a rank without tokens contributing zero (the guarded 0/0), over W.
                    locals_ = [gradient_of(model, [mbs]).double() if sum(mb.supervised for mb in mbs) > 0
                               else torch.zeros_like(truth) for mbs in window]
                    mean_of_means = torch.stack(locals_).mean(0)
                    truths[key] = (truth, relative_l2(mean_of_means, truth))
                truth, mistake = truths[key]
                if run.max_norm is not None:  # a clipping recipe: the truth is clipped the way the reference is
                    truth = truth * min(1.0, run.max_norm / (float(truth.norm()) + 1e-6))
                error = relative_l2(records[k].grad, truth)  # type: ignore[arg-type]
                if worst is None or error > worst.error:
                    worst = Window(k, rank, error, mistake)
            if worst is not None:
                out.append(worst)
    return out


def gradient_function(spec: ModelSpec, objective: object) -> Callable[..., torch.Tensor]:
    """``f(model, window) -> flat gradient`` of the declared ``objective`` over ``window[rank][microbatch]`` under
    ``spec``'s batch convention: the computation the reference chain makes."""
    from harness.battery.objective import terms

    plain = getattr(objective, "plain", True)

    def of(model: torch.nn.Module, window: Sequence[Sequence[Microbatch]]) -> torch.Tensor:
        if plain:
            return reference_gradient(model, window, spec.loss_sum).gradient
        return reference_gradient(model, window, objective=objective,  # type: ignore[arg-type]
                                  terms_of=lambda m, mb: terms(spec, objective, m, mb)).gradient  # type: ignore[arg-type]

    return of


__all__ = ["MODES", "NOISE_MULTIPLE", "NOISE_SEEDS", "SEPARATION", "Noise", "Window", "gradient_function",
           "measure_noise", "read_windows", "relative_l2"]
