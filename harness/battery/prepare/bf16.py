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
5. **The scale** (:func:`least_squares_scale`): a mistake that scales every component by one factor (a count
   rounded to bf16 divides by ``round_bf16(N)``: 0.1-0.4% on the battery's windows) stands far below the relative-L2
   bound, but the least-squares scale ``<g, t> / <t, t>`` of tens of thousands of components is known far better
   than any one of them: the bf16 rounding, spread over every component, averages out of it. So the same noise
   measurement also records how far the correct computation's own scale strays from 1, and on every window with
   supervised tokens (balanced or not: a scale needs no imbalance to show) the recipe's scale is held to
   :data:`SCALE_MULTIPLE` times that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from harness.core.reference import reference_gradient
from harness.diagnosis.evidence import first_supervised

if TYPE_CHECKING:
    from harness.battery.launch.run import Run
    from harness.battery.spec import ModelSpec
    from harness.core.microbatch import Microbatch

NOISE_SEEDS = 3
"""Initial weights the noise is measured from: the run's seed and the next ones."""

NOISE_MULTIPLE = 4.0
"""The bound is this multiple of the measured noise. Measured (``benchmarks/results/fsdp2_bf16.json``, W=2 and 3,
DDP and FSDP2): the correct recipe's error on the ranks is 0.195-0.254 of the bound (at most the noise itself), a
mean of local means 4.7-17x above it."""

SCALE_MULTIPLE = 2.0
"""The scale bound is this multiple of the correct computation's largest ``|scale - 1|`` over the seeds and windows
(:attr:`Noise.scale`), the way the relative-L2 bound is of its noise. The first seed is the run's own starting
weights, so a correct recipe's scale is itself one of the samples the bound is built from (up to the ranks' order
of summation): 2x leaves it a margin of 2 by construction. The bf16 lane's runs start from trained weights
(:mod:`harness.battery.prepare.start`), where the correct computation's own scale strays from 1 by about 1e-3, a third
of what a count rounded to bfloat16 moves it by; the figures are ``bf16_scale`` in
``benchmarks/results/fsdp2_bf16.json`` (``python benchmarks/fsdp2_bf16_bench.py``)."""

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
    scale: float | None = None
    """The largest ``|scale - 1|`` of the bf16 gradient's least-squares scale against float64 over the seeds and
    windows (:func:`least_squares_scale`); None where the scale is not judged (:attr:`unjudged`)."""
    scale_samples: tuple[float, ...] = ()
    """Each seed's largest ``|scale - 1|``."""
    unjudged: str | None = None
    """Why the scale is not judged in this lane (:func:`scale_judged`), or None."""

    @property
    def bound(self) -> float:
        return NOISE_MULTIPLE * self.noise

    @property
    def scale_bound(self) -> float | None:
        return None if self.scale is None else SCALE_MULTIPLE * self.scale

    def describe(self) -> str:
        return (f"the correct computation's own bf16 noise is {self.noise:.2e} (relative L2 against float64, on one "
                f"device, {self.mode}, over {len(self.samples)} seeds), the bound {NOISE_MULTIPLE:g}x that: "
                f"{self.bound:.2e}")

    def describe_scale(self) -> str:
        if self.scale is None:
            return f"the gradient's scale is not judged: {self.unjudged}"
        return (f"the correct computation's own scale strays from 1 by at most {self.scale:.1e} (least squares against "
                f"float64, {self.mode}, over {len(self.scale_samples)} seeds), the scale bound {SCALE_MULTIPLE:g}x "
                f"that: {SCALE_MULTIPLE * self.scale:.1e}")

    def scale_note(self) -> str:
        """What a passing verdict says of the scale."""
        if self.scale is None:
            return self.describe_scale()
        return f"its scale within {SCALE_MULTIPLE * self.scale:.1e} of 1 ({SCALE_MULTIPLE:g}x the correct one's noise)"


def scale_judged(mode: str, objective: object) -> str | None:
    """None where the bf16 lane judges the gradient's scale, else why not. Under FSDP2's bf16 parameters the logits,
    and so the loss, are bfloat16 tensors: the factor ``W / N`` a recipe multiplies its loss sum by is rounded to
    bfloat16 in every recipe, the correct one included, so the gradient's scale is known there only to bfloat16's
    relative spacing (up to 2^-8). Measured: a count rounded to bfloat16 gives the correct recipe's gradient bit for bit
    on ``uneven`` at W=2 (``benchmarks/results/fsdp2_bf16.json``). The emulation of the ranks' ``W / N`` is written
    for the plain token mean's loss sum."""
    if mode != "autocast":
        return ("under FSDP2's bf16 parameters the loss is a bfloat16 tensor, and the factor W/N every recipe "
                "multiplies it by rounds to bfloat16, so a scale of up to 0.4% (such as a count rounded to bfloat16) "
                "is every recipe's; --strategy ddp, whose autocast computes the loss in float32, sees it")
    if objective is not None and not getattr(objective, "plain", True):
        return "the scale's noise is measured for the plain token mean only"
    return None


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


def least_squares_scale(got: torch.Tensor, truth: torch.Tensor) -> float:
    """The ``s`` minimizing ``|got - s * truth|``: ``<got, truth> / <truth, truth>`` (1 for the truth itself)."""
    t = truth.double()
    denominator = float(t.dot(t))
    return float(got.double().dot(t)) / denominator if denominator > 0 else float("nan")


def measure_noise(spec: ModelSpec, windows: Sequence[Sequence[Sequence[Microbatch]]], strategy: str,
                  gradient_of: Callable[[ModelSpec], Callable[..., torch.Tensor]],
                  objective: object = None) -> Noise:
    """:class:`Noise` of ``spec``'s model on ``windows`` in ``strategy``'s bf16 mode. ``gradient_of(spec)`` gives
    ``f(model, window) -> flat gradient`` of the declared objective under ``spec``'s batch convention.

    The scale noise is measured where it can stand for the ranks' own (:func:`scale_judged`): under autocast, of the
    plain token mean. Each DDP rank backpropagates its loss sum times ``W / N`` where the one device does ``1 / N``;
    at a W that is not a power of two every bf16 rounding in the backward then falls elsewhere, so the measurement
    also takes the gradient with the loss times W (and divides it back), as the ranks do."""
    from harness.battery.prepare.probe.facts import rank_threads
    from harness.battery.prepare.start import load, start_weights

    mode = MODES.get(strategy, "autocast")
    judged = scale_judged(mode, objective)
    samples, scales = [], []
    with rank_threads():
        for i in range(NOISE_SEEDS):
            worst = worst_scale = 0.0
            seeded = replace(spec, init_seed=spec.seed + i, digest=None)
            fp64 = replace(seeded, precision="fp64")
            for window in windows:
                if sum(mb.supervised for rank in window for mb in rank) == 0:
                    continue
                # At the weights the lane's runs start from (harness.battery.prepare.start): float32's, the truth cast.
                start = start_weights(replace(seeded, precision="fp32"))
                truth = _gradient(load(fp64.build(), start), window, gradient_of(fp64), None)
                low = _gradient(load(replace(seeded, precision="fp32").build(), start), window, gradient_of(seeded),
                                mode)
                worst = max(worst, relative_l2(low, truth))
                if judged is not None:
                    continue
                worst_scale = max(worst_scale, abs(least_squares_scale(low, truth) - 1))
                world = len(window)
                if world & (world - 1):  # W = 2^j scales exactly: the rounding falls where it did
                    as_ranks = _gradient(load(replace(seeded, precision="fp32").build(), start), window,
                                         gradient_function(seeded, objective, loss_factor=world), mode) / world
                    worst_scale = max(worst_scale, abs(least_squares_scale(as_ranks, truth) - 1))
            samples.append(worst)
            scales.append(worst_scale)
    return Noise(max(samples), tuple(samples), mode, None if judged is not None else max(scales), tuple(scales),
                 judged)


@dataclass(frozen=True)
class Window:
    """What the bf16 lane read on one window, at one rank's starting weights."""

    window: int
    rank: int
    error: float
    """The rank's gradient against the float64 truth (relative L2)."""
    mistake: float
    """The mean of local means against the same truth: how far the mistake this lane must see stands."""
    scale: float = 1.0
    """The least-squares scale of the rank's gradient against the truth (:func:`least_squares_scale`)."""


def read_windows(run: Run, gradient_of: Callable[..., torch.Tensor]) -> list[Window]:
    """Each window's worst rank error and the mean of local means' distance, against the float64 gradient at the
    weights each rank started from (one truth per distinct starting point)."""
    from harness.battery.prepare.probe.facts import rank_threads

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
                    model = run.model_at(before, torch.float64, first_supervised(window))
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
                scale = least_squares_scale(records[k].grad, truth)  # type: ignore[arg-type]
                if worst is None or error > worst.error:
                    worst = Window(k, rank, error, mistake, scale)
            if worst is not None:
                out.append(worst)
    return out


def scale_finding(noise: Noise, read: Sequence[Window]) -> tuple[Window, str] | None:
    """The window whose scale strays furthest from 1, and the sentence that says so, where that is past the scale
    bound; None where every window's scale is within it."""
    if not read:
        return None
    w = max(read, key=lambda w: abs(w.scale - 1))
    off = abs(w.scale - 1)
    if noise.scale_bound is None or off <= noise.scale_bound:
        return None
    return w, (f"the gradient on rank {w.rank}, window {w.window} is {w.scale:.6f} times the float64 gradient (least "
               f"squares over every component): {off:.1e} from 1, {off / noise.scale_bound:.0f}x the scale bound; "
               f"{noise.describe_scale()}. Every component scaled by one factor: a divisor that is not the window's "
               "count (a count rounded to bfloat16 or float16, a count off by a few tokens) or a constant factor. Its "
               f"relative L2 error, {w.error:.2e}, is {w.error / noise.bound:.2f}x the relative-L2 bound, which is "
               "too coarse to see it")


def gradient_function(spec: ModelSpec, objective: object, loss_factor: float = 1.0) -> Callable[..., torch.Tensor]:
    """``f(model, window) -> flat gradient`` of the declared ``objective`` over ``window[rank][microbatch]`` under
    ``spec``'s batch convention: the computation the reference chain makes (with the plain token mean's loss sums
    times ``loss_factor``: the gradient is then that many times the objective's)."""
    from harness.battery.prepare.objective import terms

    plain = getattr(objective, "plain", True)

    def scaled(model: torch.nn.Module, mb: Microbatch) -> torch.Tensor:
        return spec.loss_sum(model, mb) * loss_factor

    def of(model: torch.nn.Module, window: Sequence[Sequence[Microbatch]]) -> torch.Tensor:
        if plain:
            return reference_gradient(model, window, spec.loss_sum if loss_factor == 1.0 else scaled).gradient
        return reference_gradient(model, window, objective=objective,  # type: ignore[arg-type]
                                  terms_of=lambda m, mb: terms(spec, objective, m, mb)).gradient  # type: ignore[arg-type]

    return of


__all__ = ["MODES", "NOISE_MULTIPLE", "NOISE_SEEDS", "SCALE_MULTIPLE", "SEPARATION", "Noise", "Window",
           "gradient_function", "least_squares_scale", "measure_noise", "read_windows", "relative_l2",
           "scale_finding", "scale_judged"]
