"""Directional finite differences with a bound derived from the step: the numbers behind
:mod:`harness.battery.prepare.probe.backward_check` (is the model's backward the gradient of its forward?) and
:mod:`harness.battery.prepare.probe.gradless` (does the loss change along a parameter without a gradient?).

Along a unit direction ``v`` of some tensors ``x`` (parameters, a module's inputs), ``phi(t) = s(x + t v)`` for a
scalar ``s`` (a loss sum, or ``<u, module(x)>``), and the central difference is compared with what the backward says
``phi'(0)`` is::

    D(e) = (phi(e) - phi(-e)) / 2e          against          a = <grad s(x), v>

**The bound, derived from e.** Taylor's theorem gives ``D(e) = phi'(0) + e^2 phi'''(xi) / 6``, and each computed
``phi(t)`` carries a rounding error ``r(t)``, which adds ``(r(e) - r(-e)) / 2e``. So for a right backward::

    |D(e) - a| <= T(e) + R(e) + G

- ``T(e) = e^2 |phi'''| / 6``, the truncation. A second step measures it: ``D(2e) - D(e) = 3 e^2 phi''' / 6 +
  O(e^4)``, so ``T(e) = |D(2e) - D(e)| / 3`` (that difference carries rounding too, which only makes it larger);
- ``R(e) = Z sigma / (sqrt(2) e)``, the rounding: ``(r(e) - r(-e)) / 2e`` has the standard deviation
  ``sigma / (sqrt(2) e)`` when one evaluation's rounding error has ``sigma``, and ``Z = 6`` standard deviations bound
  it. ``sigma`` is measured on the same points: the fourth difference ``phi(2e) - 4 phi(e) + 6 phi(0) - 4 phi(-e) +
  phi(-2e)`` is ``e^4 phi''''`` (below 1e-20 here) plus rounding of variance ``70 sigma^2``, pooled over the
  directions; and never below ``eps_L * S``, one rounding of the result (``eps_L`` of the dtype the loss is
  summed in, ``S`` the sum of its terms' magnitudes: cross-entropies are positive, so ``S = |L|``);
- ``G = eps * sum_i |g_i v_i|``, the rounding of the dot product ``a`` itself.

``e = eps^(1/3)`` (6.1e-6 in float64), the step at which truncation (``~ e^2``) and rounding (``~ eps / e``) are of
one size; ``eps`` is the machine epsilon of the lowest floating dtype the forward computes in (a model that upcasts
to float32 inside is checked at float32's epsilon and step). A direction that misses its bound is measured again at
``e / 4``: a non-differentiable point crossed by the step (a ReLU whose input passes zero between ``w - e v`` and
``w + e v``) moves the difference between steps, a wrong backward does not. The backward disagrees with the
forward when every direction misses its bound at both steps.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

Z = 6.0
"""Standard deviations of the measured rounding that the rounding term allows."""

RETRY = 4.0
"""A direction that misses its bound is measured again at ``e / RETRY``."""

SEED = 20261202
"""The directions' and cotangents' generator seed (the checks are reproducible)."""

RANK = {torch.float64: 3, torch.float32: 2, torch.bfloat16: 1, torch.float16: 1}
"""Floating dtypes by precision (higher: more precise)."""


@dataclass(frozen=True)
class Direction:
    """One direction's numbers: the central difference, the backward's value, the bound and its parts."""

    step: float
    difference: float
    backward: float
    truncation: float
    rounding: float
    dot: float

    @property
    def bound(self) -> float:
        return self.truncation + self.rounding + self.dot

    @property
    def miss(self) -> float:
        return abs(self.difference - self.backward)

    @property
    def agrees(self) -> bool:
        return self.miss <= self.bound

    def line(self) -> str:
        rel = self.miss / abs(self.backward) if self.backward else math.inf
        return (f"finite difference {self.difference:.6e}, backward {self.backward:.6e} (off by {self.miss:.2e}, "
                f"{rel:.1e} relative; bound {self.bound:.1e} at e={self.step:.1e})")


def dtypes_seen(fn: Callable[[], object]) -> dict[torch.dtype, list[str]]:
    """The floating dtypes of every tensor an operation in ``fn`` produced, with the first few operations for each
    (watched under a dispatch mode, which sees every operation, also those inside a module that casts back)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen: dict[torch.dtype, list[str]] = {}

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    names = seen.setdefault(t.dtype, [])
                    name = str(getattr(func, "__name__", func)).split(".")[0]
                    if name not in names and len(names) < 4:
                        names.append(name)
            return out

    with Watch():
        fn()
    return seen


def lowest(dtypes: Sequence[torch.dtype], default: torch.dtype) -> torch.dtype:
    """The lowest-precision floating dtype of ``dtypes`` (``default`` when there is none)."""
    return min(dtypes, key=lambda d: RANK.get(d, 3), default=default)


def custom_functions(root: torch.Tensor) -> tuple[str, ...]:
    """The custom ``torch.autograd.Function`` classes (defined outside torch) in ``root``'s backward graph."""
    found: list[str] = []
    seen: set[int] = set()
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and not str(getattr(cls, "__module__", "")).startswith("torch"):
            name = f"{cls.__module__}.{cls.__qualname__}"
            if name not in found:
                found.append(name)
        stack.extend(n for n, _ in node.next_functions)
    return tuple(found)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The evaluations run without gradients; a reentrant checkpoint then warns that none of its inputs requires
    grad, which says nothing about the model (its gradient pass, with gradients on, warns where it is true)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad")
        yield


class Line:
    """``phi(t) = s(x + t dx)`` of a function ``s`` of some tensors, evaluated in place (the tensors are moved and
    put back bitwise), each evaluation after ``reset`` (buffers restored, generator reseeded)."""

    def __init__(self, tensors: Sequence[torch.Tensor], evaluate: Callable[[], tuple[float, float]],
                 reset: Callable[[], None], eps: float) -> None:
        self.tensors = list(tensors)
        self.eps = eps
        """The machine epsilon of the dtype the evaluated value is summed in (one rounding of the result)."""
        self.base = [t.detach().clone() for t in self.tensors]
        self.evaluate = evaluate
        self.reset = reset

    def at(self, direction: Sequence[torch.Tensor], t: float) -> tuple[float, float]:
        with torch.no_grad(), quiet():
            for x, b, d in zip(self.tensors, self.base, direction):
                x.copy_(b + t * d)
            try:
                self.reset()
                return self.evaluate()
            finally:
                for x, b in zip(self.tensors, self.base):
                    x.copy_(b)


def _measure(line: Line, direction: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], eps: float,
             step: float, at0: tuple[float, float]) -> tuple[Direction, float]:
    """One direction at ``step``: its :class:`Direction` with the rounding term left for the caller (which pools
    sigma), and the fourth difference of the five points."""
    (p1, _), (m1, _) = line.at(direction, step), line.at(direction, -step)
    (p2, _), (m2, _) = line.at(direction, 2 * step), line.at(direction, -2 * step)
    d1 = (p1 - m1) / (2 * step)
    d2 = (p2 - m2) / (4 * step)
    terms = [(g.double() * d.double()) for g, d in zip(grads, direction)]
    a = float(sum(float(t.sum()) for t in terms))
    dot = eps * float(sum(float(t.abs().sum()) for t in terms))
    fourth = p2 - 4 * p1 + 6 * at0[0] - 4 * m1 + m2
    return Direction(step, d1, a, abs(d2 - d1) / 3, 0.0, dot), fourth


def directional(line: Line, directions: Sequence[Sequence[torch.Tensor]], grads: Sequence[torch.Tensor],
                 eps: float, step: float) -> list[Direction]:
    """Every direction at ``step``, with the rounding term from sigma pooled over them (at least one rounding of the
    result in the dtype it is summed in)."""
    line.reset()
    with quiet():
        at0 = line.evaluate()
    measured = [_measure(line, d, grads, eps, step, at0) for d in directions]
    pooled = math.sqrt(sum(f * f for _, f in measured) / (70 * len(measured))) if measured else 0.0
    sigma = max(line.eps * at0[1], pooled)
    return [replace(d, rounding=Z * sigma / (math.sqrt(2) * step)) for d, _ in measured]


def eps_of(values: Sequence[torch.Tensor]) -> float:
    return float(max(torch.finfo(v.dtype).eps for v in values))


def unit(shapes: Sequence[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    raw = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in shapes]
    norm = math.sqrt(sum(float(r.double().pow(2).sum()) for r in raw)) or 1.0
    return [r / norm for r in raw]


def judge(line: Line, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], eps: float, count: int,
           gen: torch.Generator) -> tuple[list[Direction], list[Direction], bool]:
    """``count`` random directions at ``e = eps^(1/3)``, those that miss again at ``e / RETRY``: (first measures,
    retries, whether every direction missed at both steps)."""
    step = eps ** (1 / 3)
    directions = [unit(tensors, gen) for _ in range(count)]
    first = directional(line, directions, grads, eps, step)
    missed = [d for d, m in zip(directions, first) if not m.agrees]
    retried = directional(line, missed, grads, eps, step / RETRY) if missed else []
    disagrees = len(missed) == len(directions) and all(not r.agrees for r in retried)
    return first, retried, disagrees


def buffers_reset(model: nn.Module, seed: int) -> Callable[[], None]:
    saved = [(b, b.detach().clone()) for b in model.buffers()]

    def reset() -> None:
        with torch.no_grad():
            for b, s in saved:
                b.copy_(s)
        torch.manual_seed(seed)

    return reset


__all__ = [
    "RETRY",
    "SEED",
    "Direction",
    "Line",
    "Z",
    "buffers_reset",
    "custom_functions",
    "directional",
    "dtypes_seen",
    "eps_of",
    "judge",
    "lowest",
    "quiet",
    "unit",
]
