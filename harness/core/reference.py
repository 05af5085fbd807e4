"""The single-device control: the gradient DDP must reproduce.

Same initial weights, every rank's microbatches on one device, and the gradient of
``(total loss sum over all ranks' windows) / (total supervised count)``: the objective stated without any
distributed machinery, so it cannot share a bug with the code under test. Under another declared objective
(:mod:`harness.core.objectives`) the same loop backpropagates each microbatch's term of that objective's numerator over
its normalizer, plus the auxiliary term over its unit's count.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from harness.core.compare import flat_grad
from harness.core.loss import loss_sum
from harness.core.microbatch import Microbatch
from harness.core.objectives import Objective
from harness.core.router_terms import bind

Terms = Callable[[nn.Module, Microbatch], "tuple[torch.Tensor, object]"]
"""One microbatch's term of the objective's numerator and its auxiliary value (None: no auxiliary term; a tensor, or
under the ``global`` unit the microbatch's router statistics, :mod:`harness.core.router_terms`)."""


@dataclass(frozen=True)
class Reference:
    gradient: torch.Tensor
    """Flat gradient vector, parameters in model order."""
    loss: float
    """The global token mean: total loss sum / total supervised count."""
    tokens: int
    """The global supervised count."""
    normalizer: float | None = None
    """The declared objective's ``Z`` (None: the token mean's, ``tokens``)."""


def reference_gradient(
    model: nn.Module,
    windows: Sequence[Sequence[Microbatch]],
    loss_sum_of: Callable[[nn.Module, Microbatch], torch.Tensor] | None = None,
    used: list[frozenset[str]] | None = None,
    *,
    objective: Objective | None = None,
    terms_of: Terms | None = None,
) -> Reference:
    """Gradient of the global token mean over ``windows[rank][microbatch]``, on a private copy of ``model``.

    ``model`` itself (its weights, its ``.grad``, its mode) is left untouched. ``loss_sum_of(model, mb)`` is one
    microbatch's loss *sum* (default: ``loss_sum(model(mb.inputs), mb.labels)``; the battery passes its run's batch
    convention, e.g. the hf dict with the shift in the loss, and a user model's logits).

    ``used``, when given, receives one set per microbatch (in ``windows`` order, rank by rank): the names of the
    parameters that received a gradient in that microbatch's backward (a parameter no forward reaches gets none).

    ``objective`` (None: the plain token mean) is the declared objective; ``terms_of(model, mb)`` gives a microbatch's
    term of its numerator and its auxiliary value (default: the harness convention, no auxiliary term).
    """
    if not windows or any(len(w) == 0 for w in windows):
        msg = "windows must hold at least one rank, each with at least one Microbatch"
        raise ValueError(msg)
    microbatches = [mb for window in windows for mb in window]
    for mb in microbatches:
        if not isinstance(mb, Microbatch):
            msg = f"windows must hold Microbatch objects, found {type(mb).__name__}"
            raise TypeError(msg)
    total = sum(mb.supervised for mb in microbatches)
    if total <= 0:
        msg = "windows hold no supervised token: the global token mean (and its gradient) is undefined"
        raise ValueError(msg)
    local = copy.deepcopy(getattr(model, "module", model))
    local.zero_grad(set_to_none=True)
    device = next(local.parameters()).device
    reached: set[str] = set()
    handles = []
    if used is not None:
        for name, p in local.named_parameters():
            if p.requires_grad:
                handles.append(p.register_hook(lambda g, name=name: reached.add(name)))
    plain = objective is None or (objective.plain and terms_of is None)
    z = float(total) if plain else objective.window_normalizer(windows)  # type: ignore[union-attr]
    if z <= 0:
        msg = f"windows hold no weight: the normalizer of {objective.name} is {z!r} (every supervised weight 0)"  # type: ignore[union-attr]
        raise ValueError(msg)
    d = 1.0 if plain or not objective.auxiliary_unit else objective.auxiliary_denominator(windows)  # type: ignore[union-attr]
    # A global router term's statistics are the whole window's: a first pass without gradients sums them.
    finish = bind(None if plain or terms_of is None else objective.auxiliary_unit,  # type: ignore[union-attr]
                  lambda mb: terms_of(local, mb.to(device))[1], microbatches)  # type: ignore[misc]
    loss = 0.0
    for mb in microbatches:
        reached.clear()
        # One backward per microbatch keeps memory flat; dividing each sum by the same total is exactly
        # d(sum of sums)/d(theta) / N.
        if plain:
            if loss_sum_of is None:
                s = loss_sum(local(mb.inputs.to(device)), mb.labels.to(device))
            else:
                s = loss_sum_of(local, mb.to(device))
            (s / total).backward()
            loss += float(s.detach())
        else:
            here = mb.to(device)
            if terms_of is None:
                s, aux = objective.term(local(here.inputs), here), None  # type: ignore[union-attr]
            else:
                s, value = terms_of(local, here)
                aux = finish(value)
            step = s / z if aux is None else s / z + aux / d
            step.backward()
            loss += float(step.detach())
        if used is not None:
            used.append(frozenset(reached))
    for h in handles:
        h.remove()
    if plain:
        return Reference(gradient=flat_grad(local), loss=loss / total, tokens=total)
    return Reference(gradient=flat_grad(local), loss=loss, tokens=total, normalizer=z)
