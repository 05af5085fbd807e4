"""Is the model's backward the gradient of its forward? A directional finite-difference check on one microbatch, in
float64, before any rank starts.

The single-device reference runs the model's own backward, so parity cannot see a backward that is wrong: a custom
``torch.autograd.Function`` (a fused kernel, a hand-written attention) whose ``backward`` is not the derivative of
its ``forward`` passes every check. :func:`check_backward` compares, along a few random unit directions ``v`` of the
parameters that receive a gradient, the central difference of ``phi(t) = L(w + t v)`` (``L``: the loss sum of one
battery microbatch) with what the backward says ``phi'(0)`` is::

    D(e) = (phi(e) - phi(-e)) / 2e          against          a = <grad L(w), v>

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

**Which module, and whose fault.** When it disagrees, each module that ran is checked alone, at the inputs it got in
the forward: the same test of ``s(x, theta) = <u, module(x, theta)>`` for a random cotangent ``u``, along a random
direction of its floating inputs and its parameters. The modules that miss while every child passes are named: the
disagreement is in their own code (a leaf's ``forward``, or a ``forward`` that calls a custom Function between its
children). The backward is *wrong* when a custom ``torch.autograd.Function`` (defined outside torch) lies in such a
module's graph (or, not narrowed down, in the model's): its hand-written ``backward`` is the model's fault, and
:func:`harness.battery.facts.probe` refuses the model. Where none does, torch's own derivatives are right and the
forward chose to stop a gradient (``.detach()``, a ``torch.no_grad()`` region, a tensor hook): a note says so, and
the battery judges the gradient the model's backward defines, which is the one training uses. (A straight-through
estimator written as a custom Function is refused too: its backward is not the gradient of its forward by design.)

The check runs on a float64 copy of the model; a model that cannot be cast or cannot run in float64 is checked in its
own dtype, at that dtype's epsilon and step, and the note says so. Each evaluation restores the buffers and reseeds
torch's generator, so a forward that updates running statistics or draws random numbers computes one function.
Parameters that receive no gradient are outside these directions (:mod:`harness.battery.gradless` names their cause).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from harness.battery.spec import ModelSpec
from harness.core.microbatch import Microbatch

DIRECTIONS = 3
"""Random directions of the whole model's parameters."""

Z = 6.0
"""Standard deviations of the measured rounding that the rounding term allows."""

RETRY = 4.0
"""A direction that misses its bound is measured again at ``e / RETRY``."""

SEED = 20261202
"""The directions' and cotangents' generator seed (the check is reproducible)."""

_RANK = {torch.float64: 3, torch.float32: 2, torch.bfloat16: 1, torch.float16: 1}


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


@dataclass(frozen=True)
class ModuleMiss:
    """A module whose own backward misses its finite difference."""

    name: str
    kind: str
    direction: Direction
    functions: tuple[str, ...] = ()
    """The custom ``torch.autograd.Function`` classes in the module's own graph."""


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
    return min(dtypes, key=lambda d: _RANK.get(d, 3), default=default)


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
def _quiet() -> Iterator[None]:
    """The evaluations run without gradients; a reentrant checkpoint then warns that none of its inputs requires
    grad, which says nothing about the model (its gradient pass, with gradients on, warns where it is true)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad")
        yield


class _Line:
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
        with torch.no_grad(), _quiet():
            for x, b, d in zip(self.tensors, self.base, direction):
                x.copy_(b + t * d)
            try:
                self.reset()
                return self.evaluate()
            finally:
                for x, b in zip(self.tensors, self.base):
                    x.copy_(b)


def _measure(line: _Line, direction: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], eps: float,
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


def _directional(line: _Line, directions: Sequence[Sequence[torch.Tensor]], grads: Sequence[torch.Tensor],
                 eps: float, step: float) -> list[Direction]:
    """Every direction at ``step``, with the rounding term from sigma pooled over them (at least one rounding of the
    result in the dtype it is summed in)."""
    line.reset()
    with _quiet():
        at0 = line.evaluate()
    measured = [_measure(line, d, grads, eps, step, at0) for d in directions]
    pooled = math.sqrt(sum(f * f for _, f in measured) / (70 * len(measured))) if measured else 0.0
    sigma = max(line.eps * at0[1], pooled)
    return [replace(d, rounding=Z * sigma / (math.sqrt(2) * step)) for d, _ in measured]


def _eps_of(values: Sequence[torch.Tensor]) -> float:
    return float(max(torch.finfo(v.dtype).eps for v in values))


def _unit(shapes: Sequence[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    raw = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in shapes]
    norm = math.sqrt(sum(float(r.double().pow(2).sum()) for r in raw)) or 1.0
    return [r / norm for r in raw]


def _judge(line: _Line, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], eps: float, count: int,
           gen: torch.Generator) -> tuple[list[Direction], list[Direction], bool]:
    """``count`` random directions at ``e = eps^(1/3)``, those that miss again at ``e / RETRY``: (first measures,
    retries, whether every direction missed at both steps)."""
    step = eps ** (1 / 3)
    directions = [_unit(tensors, gen) for _ in range(count)]
    first = _directional(line, directions, grads, eps, step)
    missed = [d for d, m in zip(directions, first) if not m.agrees]
    retried = _directional(line, missed, grads, eps, step / RETRY) if missed else []
    disagrees = len(missed) == len(directions) and all(not r.agrees for r in retried)
    return first, retried, disagrees


def _buffers_reset(model: nn.Module, seed: int) -> Callable[[], None]:
    saved = [(b, b.detach().clone()) for b in model.buffers()]

    def reset() -> None:
        with torch.no_grad():
            for b, s in saved:
                b.copy_(s)
        torch.manual_seed(seed)

    return reset


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    """The tensors in a module's output or arguments: a tensor, tuples, lists, dicts, dataclass-like objects."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, Mapping):
        for x in obj.values():
            yield from _tensors(x)
    elif hasattr(obj, "__dict__") and not isinstance(obj, nn.Module):
        for x in vars(obj).values():
            yield from _tensors(x)


def _replace(obj: Any, swap: dict[int, torch.Tensor]) -> Any:
    """``obj`` with each tensor whose id is in ``swap`` replaced (tuples, lists and dicts rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return swap.get(id(obj), obj)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_replace(x, swap) for x in obj)
    if isinstance(obj, list):
        return [_replace(x, swap) for x in obj]
    if isinstance(obj, dict):
        return {k: _replace(v, swap) for k, v in obj.items()}
    return obj


def _calls(model: nn.Module, forward: Callable[[], object]) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Each module's first call in one forward: its arguments, detached."""
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in calls:
                swap = {id(t): t.detach().clone() for t in _tensors((args, kwargs))}
                calls[name] = (_replace(args, swap), _replace(kwargs, swap))

        return record

    handles = [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in model.named_modules()]
    try:
        with torch.no_grad(), _quiet():
            forward()
    finally:
        for h in handles:
            h.remove()
    return calls


def _module_check(model: nn.Module, name: str, call: tuple[tuple[Any, ...], dict[str, Any]], eps: float,
                  gen: torch.Generator, reset: Callable[[], None]) -> tuple[Direction, tuple[str, ...]] | None:
    """The module ``name`` alone at its recorded call: ``s = <u, module(x)>`` along one random direction of its
    floating inputs and its parameters; the direction that misses at both steps (None: it agrees, or nothing to
    move)."""
    module = model.get_submodule(name)
    args, kwargs = call
    inputs = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
    params = [p for p in module.parameters() if p.requires_grad]
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    swap = {id(x): leaf for x, leaf in zip(inputs, leaves)}
    reset()
    with torch.enable_grad():
        out = [t for t in _tensors(module(*_replace(args, swap), **_replace(kwargs, swap))) if t.is_floating_point()]
        if not out:
            return None
        cot = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in out]
        s = sum((t * u).sum() for t, u in zip(out, cot))
        wrt = [*leaves, *params]
        needs = [w for w in wrt if w.requires_grad]
        if not isinstance(s, torch.Tensor) or not s.requires_grad or not needs:
            return None
        functions = custom_functions(s)
        got = torch.autograd.grad(s, needs, allow_unused=True)
    by_id = {id(w): g for w, g in zip(needs, got) if g is not None}
    grads = [by_id.get(id(w), torch.zeros_like(w)) for w in wrt]

    def evaluate() -> tuple[float, float]:
        with torch.no_grad():
            ys = [t for t in _tensors(module(*_replace(args, swap), **_replace(kwargs, swap)))
                  if t.is_floating_point()]
        return (float(sum(float((y.double() * u.double()).sum()) for y, u in zip(ys, cot))),
                float(sum(float((y.double() * u.double()).abs().sum()) for y, u in zip(ys, cot))))

    line = _Line(wrt, evaluate, reset, _eps_of(out))
    _, retried, disagrees = _judge(line, wrt, grads, eps, 1, gen)
    return (retried[0], functions) if disagrees else None


def _localize(model: nn.Module, forward: Callable[[], object], eps: float, gen: torch.Generator,
              reset: Callable[[], None]) -> tuple[ModuleMiss, ...]:
    """The modules whose own check misses while none of their descendants' does."""
    reset()
    calls = _calls(model, forward)
    missed: dict[str, tuple[Direction, tuple[str, ...]]] = {}
    names = [n for n, _ in model.named_modules() if n in calls]
    for name in sorted(names, key=lambda n: -n.count(".") - (n != "")):  # deepest first
        with contextlib.suppress(Exception):  # a module that cannot be called alone is not narrowed down
            found = _module_check(model, name, calls[name], eps, gen, reset)
            if found is not None:
                missed[name] = found

    def below(parent: str, child: str) -> bool:
        return child != parent and (parent == "" or child.startswith(parent + "."))

    own = [n for n in missed if not any(below(n, other) for other in missed)]
    return tuple(ModuleMiss(n, type(model.get_submodule(n)).__name__, *missed[n]) for n in own)


def moves_loss(spec: ModelSpec, model: nn.Module, mb: Microbatch, groups: Mapping[str, Sequence[nn.Parameter]],
               eps: float | None = None) -> dict[str, bool]:
    """Whether the loss sum of ``mb`` changes along each group of parameters (one random direction each): the
    central difference beyond the bound of a zero derivative (:func:`check_backward`'s, with no gradient to
    compare). A parameter no forward reaches leaves every evaluation bitwise the same."""
    out: dict[str, bool] = {}
    if not groups:
        return out
    gen = torch.Generator().manual_seed(SEED)
    reset = _buffers_reset(model, SEED)
    with torch.random.fork_rng(devices=[]):
        reset()
        with torch.no_grad(), _quiet():
            at = spec.loss_sum(model, mb)
        floor = _eps_of([at])
        eps = floor if eps is None else eps

        def evaluate() -> tuple[float, float]:
            with torch.no_grad():
                value = float(spec.loss_sum(model, mb))
            return value, abs(value)

        for name, params in groups.items():
            tensors = list(params)
            line = _Line(tensors, evaluate, reset, floor)
            (found,) = _directional(line, [_unit(tensors, gen)], [torch.zeros_like(t) for t in tensors], eps,
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
        reset = _buffers_reset(model, SEED)
        reset()
        computed = dtypes_seen(lambda: spec.loss_sum(model, mb))
        eps = float(torch.finfo(lowest([d for d in computed if _RANK.get(d, 3) <= _RANK.get(own, 3)],
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
        first, retried, disagrees = _judge(_Line(moved, evaluate, reset, _eps_of([loss])), moved, grads, eps,
                                           directions, gen)
        modules: tuple[ModuleMiss, ...] = ()
        if disagrees:
            modules = _localize(model, lambda: spec.loss_sum(model, mb), eps, gen, reset)
    return BackwardCheck(str(own), eps, tuple(first), tuple(retried), disagrees, modules, functions, not_float64,
                         time.perf_counter() - started)


__all__ = ["BackwardCheck", "Direction", "ModuleMiss", "check_backward", "custom_functions", "dtypes_seen",
           "lowest", "moves_loss"]
