"""Which module a backward that disagrees with its forward lies in: each module that ran, checked alone at the inputs
it got in the forward (:func:`localize`), by the same directional finite difference
(:mod:`harness.battery.prepare.probe.finite_difference`) of ``s(x, theta) = <u, module(x, theta)>`` for a random
cotangent ``u``, along a random direction of its floating inputs and its parameters. The modules that miss while every
descendant passes are named, with the custom ``torch.autograd.Function`` classes in their own graph."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.battery.prepare.probe.finite_difference import Direction, Line, custom_functions, eps_of, judge, quiet


@dataclass(frozen=True)
class ModuleMiss:
    """A module whose own backward misses its finite difference."""

    name: str
    kind: str
    direction: Direction
    functions: tuple[str, ...] = ()
    """The custom ``torch.autograd.Function`` classes in the module's own graph."""


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
        with torch.no_grad(), quiet():
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

    line = Line(wrt, evaluate, reset, eps_of(out))
    _, retried, disagrees = judge(line, wrt, grads, eps, 1, gen)
    return (retried[0], functions) if disagrees else None


def localize(model: nn.Module, forward: Callable[[], object], eps: float, gen: torch.Generator,
             reset: Callable[[], None]) -> tuple[ModuleMiss, ...]:
    """The modules whose own check misses while none of their descendants' does."""
    reset()
    calls = _calls(model, forward)
    missed: dict[str, tuple[Direction, tuple[str, ...]]] = {}
    for name in (n for n, _ in model.named_modules() if n in calls):
        with contextlib.suppress(Exception):  # a module that cannot be called alone is not narrowed down
            found = _module_check(model, name, calls[name], eps, gen, reset)
            if found is not None:
                missed[name] = found

    def below(parent: str, child: str) -> bool:
        return child != parent and (parent == "" or child.startswith(parent + "."))

    own = [n for n in missed if not any(below(n, other) for other in missed)]
    return tuple(ModuleMiss(n, type(model.get_submodule(n)).__name__, *missed[n]) for n in own)


__all__ = ["ModuleMiss", "localize"]
