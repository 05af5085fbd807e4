"""Is the model's backward the gradient of its forward? A directional finite-difference check on one microbatch, in
float64, before any rank starts.

The single-device reference runs the model's own backward, so parity cannot see a backward that is wrong: a custom
``torch.autograd.Function`` (a fused kernel, a hand-written attention) whose ``backward`` is not the derivative of
its ``forward`` passes every check. :func:`check_backward` compares, along a few random unit directions ``v`` of the
parameters that receive a gradient, the central difference of ``phi(t) = L(w + t v)`` (``L``: the loss sum of one
battery microbatch) with what the backward says ``phi'(0)`` is::

    D(e) = (phi(e) - phi(-e)) / 2e          against          a = <grad L(w), v>

The bound is derived from the step ``e`` (:mod:`harness.battery.prepare.probe.finite_difference`): the truncation
``e^2 |phi'''| / 6`` measured by a second step, plus six standard deviations of the rounding measured on the same
points, plus the dot product's own rounding; ``e = eps^(1/3)``, ``eps`` that of the lowest floating dtype the forward
computes in. A direction that misses its bound is measured again at ``e / 4``: a non-differentiable point crossed by
the step (a ReLU whose input passes zero between ``w - e v`` and ``w + e v``) moves the difference between steps, a
wrong backward does not. The backward disagrees with the forward when every direction misses its bound at both
steps.

**Which module, and whose fault.** When it disagrees, each module that ran is checked alone, at the inputs it got in
the forward: the same test of ``s(x, theta) = <u, module(x, theta)>`` for a random cotangent ``u``, along a random
direction of its floating inputs and its parameters. The modules that miss while every child passes are named: the
disagreement is in their own code (a leaf's ``forward``, or a ``forward`` that calls a custom Function between its
children). The backward is *wrong* when a custom ``torch.autograd.Function`` (defined outside torch) lies in such a
module's graph (or, not narrowed down, in the model's): its hand-written ``backward`` is the model's fault, and
:func:`harness.battery.prepare.probe.facts.probe` refuses the model. Where none does, torch's own derivatives are right
and the forward chose to stop a gradient (``.detach()``, a ``torch.no_grad()`` region, a tensor hook): a note says so,
and the battery judges the gradient the model's backward defines, which is the one training uses. (A straight-through
estimator written as a custom Function is refused too: its backward is not the gradient of its forward by design.)

The check runs on a float64 copy of the model; a model that cannot be cast or cannot run in float64 is checked in its
own dtype, at that dtype's epsilon and step, and the note says so. Each evaluation restores the buffers and reseeds
torch's generator, so a forward that updates running statistics or draws random numbers computes one function.
Parameters that receive no gradient are outside these directions (:mod:`harness.battery.prepare.probe.gradless` names
their cause).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from harness.battery.prepare.probe.finite_difference import (
    RANK,
    RETRY,
    SEED,
    Direction,
    Line,
    Z,
    buffers_reset,
    custom_functions,
    directional,
    dtypes_seen,
    eps_of,
    judge,
    lowest,
    quiet,
    unit,
)
from harness.battery.prepare.probe.module_check import ModuleMiss, localize
from harness.battery.spec import ModelSpec
from harness.core.microbatch import Microbatch

DIRECTIONS = 3
"""Random directions of the whole model's parameters."""


@dataclass(frozen=True)
class BackwardCheck:
    """What :func:`check_backward` found."""

    dtype: str
    """The dtype the check computed in (``"torch.float64"`` unless the model cannot run in it)."""
    eps: float
    """The machine epsilon the bound uses (of the lowest dtype the forward computes in)."""
    directions: tuple[Direction, ...]
    retried: tuple[Direction, ...] = ()
    """The directions that missed at ``e``, measured again at ``e / RETRY`` (in order)."""
    disagrees: bool = False
    """Every direction missed its bound at both steps: the backward is not the gradient of the forward."""
    modules: tuple[ModuleMiss, ...] = ()
    """The modules the disagreement lies in (empty: not narrowed down, or none)."""
    functions: tuple[str, ...] = ()
    """The custom ``torch.autograd.Function`` classes in the loss's graph (outside torch)."""
    not_float64: str | None = None
    """Why the check did not run in float64 (the model's error on the cast or in a float64 forward)."""
    seconds: float = 0.0

    @property
    def wrong(self) -> bool:
        """The disagreement lies where a custom autograd.Function's backward is: the model's fault."""
        if not self.disagrees:
            return False
        return any(m.functions for m in self.modules) if self.modules else bool(self.functions)

    def note(self) -> str | None:
        """A sentence for the model's notes when the backward was checked otherwise than documented, or disagrees
        without a custom Function to blame (None otherwise)."""
        out = []
        if self.not_float64 is not None:
            out.append(f"the model's backward was checked in {self.dtype}, not float64 (the model cannot run in "
                       f"float64: {self.not_float64}): the finite-difference bound is {self.dtype}'s, about "
                       f"{self.eps ** (2 / 3):.0e} of the loss")
        if self.disagrees and not self.wrong:
            out.append(f"the model's backward is not the gradient of its forward ({self._where()}), and no custom "
                       "autograd.Function lies there: the forward stops a gradient itself (.detach(), a "
                       "torch.no_grad() region, a tensor hook). The battery judges the gradient the model's own "
                       "backward defines, the one training uses")
        return "; ".join(out) or None

    def _where(self) -> str:
        if not self.modules:
            return "not narrowed to one module"
        return "in " + "; ".join((f"module {m.name} ({m.kind})" if m.name else
                                  f"{m.kind}.forward itself, between its submodules") + f": {m.direction.line()}"
                                 for m in self.modules)

    def failure(self, model: str) -> str:
        """The sentence that names the wrong backward as the model's, and where it lies."""
        worst = max(self.retried or self.directions, key=lambda d: d.miss / d.bound if d.bound else math.inf)
        text = (f"{model}'s backward is not the gradient of its forward: along {len(self.directions)} random "
                f"directions v of its parameters, the central difference (L(w + e v) - L(w - e v)) / 2e of one "
                f"battery microbatch's loss sum ({self.dtype}) misses the backward's <grad L, v> beyond the bound "
                f"derived from e (truncation e^2 |L'''| / 6 + rounding {Z:g} sigma / (sqrt(2) e)) at e and at "
                f"e / {RETRY:g}; worst: {worst.line()}")
        if self.modules:
            text += f". Each module checked alone at the inputs it got, the wrong backward lies {self._where()}"
        else:
            text += ". Every module checked alone agrees: the wrong gradient comes from how they are joined"
        blamed = [f for m in self.modules for f in m.functions] or list(self.functions)
        text += (f". It runs the custom autograd.Function(s) {', '.join(dict.fromkeys(blamed))}: check "
                 "the backward (torch.autograd.gradcheck in float64)")
        return (text + ". The battery cannot judge a training step on this model: the single-device reference runs "
                "the same backward, so parity would pass a wrong gradient")


def moves_loss(spec: ModelSpec, model: nn.Module, mb: Microbatch, groups: Mapping[str, Sequence[nn.Parameter]],
               eps: float | None = None) -> dict[str, bool]:
    """Whether the loss sum of ``mb`` changes along each group of parameters (one random direction each): the
    central difference beyond the bound of a zero derivative (:func:`check_backward`'s, with no gradient to
    compare). A parameter no forward reaches leaves every evaluation bitwise the same."""
    out: dict[str, bool] = {}
    if not groups:
        return out
    gen = torch.Generator().manual_seed(SEED)
    reset = buffers_reset(model, SEED)
    with torch.random.fork_rng(devices=[]):
        reset()
        with torch.no_grad(), quiet():
            at = spec.loss_sum(model, mb)
        floor = eps_of([at])
        eps = floor if eps is None else eps

        def evaluate() -> tuple[float, float]:
            with torch.no_grad():
                value = float(spec.loss_sum(model, mb))
            return value, abs(value)

        for name, params in groups.items():
            tensors = list(params)
            line = Line(tensors, evaluate, reset, floor)
            (found,) = directional(line, [unit(tensors, gen)], [torch.zeros_like(t) for t in tensors], eps,
                                    eps ** (1 / 3))
            out[name] = not found.agrees
    return out


def check_backward(spec: ModelSpec, mb: Microbatch, directions: int = DIRECTIONS) -> BackwardCheck:
    """The directional finite-difference check of ``spec``'s model on ``mb`` (see the module's docstring): in
    float64 on a copy, in the model's own dtype when it cannot run in float64. Gradients on, the caller's RNG state
    untouched."""
    started = time.perf_counter()
    not_float64 = None
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        try:
            model = replace(spec, precision="fp64").build()
            spec.loss_sum(model, mb)
        except Exception as exc:
            text = str(exc).strip().splitlines()
            not_float64 = f"{type(exc).__name__}: {text[0] if text else ''}"
            model = spec.build()
        own = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float64)
        params = [p for p in model.parameters() if p.requires_grad]
        reset = buffers_reset(model, SEED)
        reset()
        computed = dtypes_seen(lambda: spec.loss_sum(model, mb))
        eps = float(torch.finfo(lowest([d for d in computed if RANK.get(d, 3) <= RANK.get(own, 3)],
                                       own)).eps)
        reset()
        model.zero_grad(set_to_none=True)
        loss = spec.loss_sum(model, mb)
        functions = custom_functions(loss)
        loss.backward()
        moved = [p for p in params if p.grad is not None]
        grads = [p.grad.detach().clone() for p in moved]  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(SEED)

        def evaluate() -> tuple[float, float]:
            with torch.no_grad():
                value = float(spec.loss_sum(model, mb))
            return value, abs(value)

        if not moved:
            return BackwardCheck(str(own), eps, (), not_float64=not_float64, functions=functions,
                                 seconds=time.perf_counter() - started)
        first, retried, disagrees = judge(Line(moved, evaluate, reset, eps_of([loss])), moved, grads, eps,
                                           directions, gen)
        modules: tuple[ModuleMiss, ...] = ()
        if disagrees:
            modules = localize(model, lambda: spec.loss_sum(model, mb), eps, gen, reset)
    return BackwardCheck(str(own), eps, tuple(first), tuple(retried), disagrees, modules, functions, not_float64,
                         time.perf_counter() - started)


__all__ = [
    "DIRECTIONS",
    "RETRY",
    "BackwardCheck",
    "Direction",
    "ModuleMiss",
    "Z",
    "check_backward",
    "custom_functions",
    "dtypes_seen",
    "lowest",
    "moves_loss",
]
