"""Why a parameter that requires grad gets no gradient, found by watching the forward, never guessed from its name.

DDP needs ``find_unused_parameters=True`` for any such parameter, whatever the cause; the user needs the cause, since
the fixes differ. :func:`watch` records, with a forward pre-hook on every module, each call of each module: whether
gradients were on, and whether it ran inside a reentrant activation checkpoint (the forward of
``torch.utils.checkpoint.CheckpointFunction`` on the stack) whose tensor inputs need no gradient.
:func:`find_causes` then names, per parameter without a gradient, the first cause that fits:

- ``routed``: a gradient reached it from another of the probe's microbatches, or its module never ran while a sibling
  of the same kind in the same container did: a branch the data decides (an expert no token was routed to);
- ``checkpoint``: its module ran only inside a reentrant checkpoint whose inputs need no gradient. Such a checkpoint
  runs its function under ``torch.no_grad()`` and recomputes it in backward only when its output needs a gradient,
  which it does only when an input does: the forward uses the parameter and the checkpoint drops its gradient;
- ``no_grad``: its module ran only with gradients off (a ``torch.no_grad()`` region of the forward);
- ``dropped``: the loss changes along it (a directional finite difference beyond its bound,
  :mod:`harness.battery.prepare.probe.backward_check`) yet no gradient arrives: a ``.detach()``, or a custom Function
  whose backward returns None for it;
- ``result_unused``: its module ran with gradients on, and the loss does not change along it: its result never
  reaches the loss;
- ``never``: its module never ran and the loss does not change along it: no forward reaches it (a head for another
  task, a leftover layer).

:func:`unused_notes` says which parameters miss a gradient in the single-device reference, per window, rank and
microbatch, with these causes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

CAUSES = ("routed", "checkpoint", "no_grad", "dropped", "result_unused", "never")
"""Every cause :func:`find_causes` names, in the order it tries them."""


@dataclass
class Calls:
    """What :func:`watch` saw of one module in one forward."""

    with_grad: int = 0
    without_grad: int = 0
    checkpoint_no_grad_inputs: int = 0
    """Calls inside a reentrant checkpoint's forward whose tensor inputs need no gradient."""
    rows: list[int] = field(default_factory=list)
    """The leading size of each call's first tensor input (0: it ran on no rows)."""


def _in_reentrant_checkpoint() -> tuple[bool, bool]:
    """(inside the forward of torch's reentrant checkpoint, whether one of its tensor inputs needs a gradient)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "forward" and frame.f_globals.get("__name__") == "torch.utils.checkpoint":
            args = frame.f_locals.get("args", ())
            return True, any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        frame = frame.f_back  # type: ignore[assignment]
    return False, False


@contextlib.contextmanager
def watch(model: nn.Module) -> Iterator[dict[str, Calls]]:
    """Record every module call of ``model`` during the body (see :class:`Calls`)."""
    seen: dict[str, Calls] = {}

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...]) -> None:
            calls = seen.setdefault(name, Calls())
            if torch.is_grad_enabled():
                calls.with_grad += 1
            else:
                calls.without_grad += 1
                inside, needs = _in_reentrant_checkpoint()
                if inside and not needs:
                    calls.checkpoint_no_grad_inputs += 1
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None and first.dim() > 0:
                calls.rows.append(int(first.shape[0]))

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class Gradless:
    """A parameter that requires grad and got no gradient, its module and the cause (one of :data:`CAUSES`)."""

    name: str
    module: str
    cause: str
    where: str = ""
    """The modules that locate the cause: the checkpointed modules, or the siblings that ran."""


def _owners(model: nn.Module) -> dict[str, str]:
    """Each parameter's module (the first that holds it directly)."""
    out: dict[str, str] = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            out.setdefault(f"{mod_name}.{p_name}" if mod_name else p_name, mod_name)
    return out


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _sibling_ran(model: nn.Module, module: str, seen: Mapping[str, Calls]) -> str | None:
    """A sibling of ``module`` of the same kind, in the same container, that ran (None: none did)."""
    if not module:
        return None
    parent = model.get_submodule(_parent(module))
    if not isinstance(parent, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return None
    kind = type(model.get_submodule(module))
    prefix = _parent(module)
    for child, sub in parent.named_children():
        name = f"{prefix}.{child}" if prefix else child
        if name != module and type(sub) is kind and seen.get(name, Calls()).with_grad:
            return name
    return None


def find_causes(model: nn.Module, missing: Sequence[str], seen: Mapping[str, Calls],
                reached_elsewhere: set[str], moves_loss: Mapping[str, bool]) -> tuple[Gradless, ...]:
    """The cause of each parameter in ``missing`` (names, model order): ``seen`` the module calls of the microbatch
    they missed a gradient in, ``reached_elsewhere`` the parameters another microbatch gave a gradient, and
    ``moves_loss`` whether the loss changes along each module's parameters (by module name; see
    :func:`harness.battery.prepare.probe.backward_check.moves_loss`)."""
    owners = _owners(model)
    checkpointed = {n for n, c in seen.items() if c.checkpoint_no_grad_inputs}
    outer = sorted(n for n in checkpointed if _parent(n) not in checkpointed or not n)
    out = []
    for name in missing:
        module = owners.get(name, "")
        calls = seen.get(module, Calls())
        sibling = _sibling_ran(model, module, seen) if not (calls.with_grad or calls.without_grad) else None
        moves = moves_loss.get(module, False)
        if name in reached_elsewhere:
            out.append(Gradless(name, module, "routed"))
        elif sibling is not None and not moves:
            out.append(Gradless(name, module, "routed", sibling))
        elif calls.checkpoint_no_grad_inputs and not calls.with_grad:
            where = [n for n in outer if not n or module == n or module.startswith(n + ".")]
            out.append(Gradless(name, module, "checkpoint", ", ".join(where)))
        elif calls.without_grad and not calls.with_grad:
            out.append(Gradless(name, module, "no_grad"))
        elif moves:
            out.append(Gradless(name, module, "dropped"))
        elif calls.with_grad:
            out.append(Gradless(name, module, "result_unused"))
        else:
            out.append(Gradless(name, module, "never"))
    return tuple(out)


def _names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _params(names: Sequence[str]) -> str:
    return f"parameter{'s' if len(names) > 1 else ''} {_names(names)}"


_WHY = {
    "never": "no forward reaches {them}: {its} module{s} {modules} never ran, and the loss does not change "
             "along {them}",
    "routed": "a branch the data decides (an expert no token was routed to): {its} module{s} {modules} did not "
              "reach the loss from this microbatch{where}, and another microbatch or a sibling reaches it",
    "checkpoint": "the forward uses {them}, inside a reentrant activation checkpoint "
                  "(torch.utils.checkpoint.checkpoint(..., use_reentrant=True) around {where}) whose inputs need no "
                  "gradient: such a checkpoint runs its function under torch.no_grad() and recomputes it in backward "
                  "only when an input needs a gradient, so the checkpoint drops {their} gradient and training never "
                  "updates {them}. Pass use_reentrant=False, or make the checkpoint's input require grad (Hugging "
                  "Face: model.enable_input_require_grads())",
    "no_grad": "{its} module{s} {modules} ran under torch.no_grad() (gradients off) in the forward",
    "dropped": "the forward uses {them} (the loss changes along {them}, beyond the finite-difference bound) but no "
               "gradient reaches {them}: a .detach(), or a custom autograd.Function whose backward returns None "
               "for {them}",
    "result_unused": "{its} module{s} {modules} ran, but {their} result never reaches the loss",
}


def sentence(group: Sequence[Gradless]) -> str:
    """One sentence for parameters of one cause (the probe's and the reference's notes say it alike, so a report that
    holds both says it once)."""
    names = [g.name for g in group]
    modules = list(dict.fromkeys(g.module or "(the model itself)" for g in group))
    wheres = list(dict.fromkeys(g.where for g in group if g.where))
    many = len(names) > 1
    cause = group[0].cause
    where = f" while {_names(wheres, 4)} ran" if wheres and cause == "routed" else _names(wheres, 4)
    why = _WHY[cause].format(
        them="them" if many else "it", their="their" if many else "its", its="their" if many else "its",
        s="s" if len(modules) > 1 else "", modules=_names(modules, 4), where=where)
    return (f"the model's {_params(names)} require{'' if many else 's'} grad but get{'' if many else 's'} no "
            f"gradient from a battery microbatch: {why}")


REMEDY = ("DDP needs find_unused_parameters=True for a model whose parameters miss a gradient, or those parameters "
          "frozen (requires_grad=False) or removed")
"""What DDP needs, whatever the cause."""


def notes(gradless: Sequence[Gradless]) -> tuple[str, ...]:
    """A sentence per cause (in :data:`CAUSES` order), then DDP's remedy (:data:`REMEDY`)."""
    out = [sentence(group) for group in _by_cause(gradless)]
    return (*out, REMEDY) if out else ()


def _by_cause(gradless: Sequence[Gradless]) -> list[list[Gradless]]:
    groups = [[g for g in gradless if g.cause == cause] for cause in CAUSES]
    return [g for g in groups if g]


def unused_notes(chain: Any, gradless: Sequence[Gradless] = ()) -> tuple[bool, tuple[str, ...]]:
    """Whether some parameter misses a gradient in some microbatch's backward of the single-device reference
    (``chain``: :class:`harness.battery.prepare.chain.Chain`; DDP then needs ``find_unused_parameters=True``), and the
    sentences that say which, where; ``gradless``: the causes the model probe found
    (:attr:`harness.battery.prepare.probe.facts.ModelFacts.gradless`)."""
    trainable = set(chain.trainable)
    reached: set[str] = set()
    missing: dict[str, list[str]] = {}
    for k, window in enumerate(chain.used):
        for r, mbs in enumerate(window):
            for m, names in enumerate(mbs):
                reached |= names
                for name in trainable - names:
                    missing.setdefault(name, []).append(f"window {k}, rank {r}, microbatch {m}")
    if not missing:
        return False, ()
    order = [n for n in chain.trainable if n in missing]
    never = [n for n in order if n not in reached]
    sometimes = [n for n in order if n in reached]
    notes_ = []
    if never:
        known = {g.name: g for g in gradless}
        explained = [known[n] for n in never if n in known and known[n].cause != "routed"]
        notes_ += [sentence(group) for group in _by_cause(explained)]
        rest = [n for n in never if n not in {g.name for g in explained}]
        if rest:
            notes_.append(f"the model's {_params(rest)} get{'s' if len(rest) == 1 else ''} no gradient in any "
                          "microbatch of the single-device reference")
    for name in sometimes[:6]:
        where = missing[name]
        ranks = sorted({w.split(", ")[1] for w in where})
        notes_.append(f"the model's parameter {name} gets no gradient in {where[0]}"
                      f"{f' and {len(where) - 1} other microbatch(es)' if len(where) > 1 else ''} but does elsewhere "
                      f"(a branch the data decides, e.g. an expert no token routes to; missing on {', '.join(ranks)})")
    if len(sometimes) > 6:
        notes_.append(f"and {len(sometimes) - 6} more parameters miss a gradient in some microbatches only")
    return True, tuple(notes_)


__all__ = ["CAUSES", "REMEDY", "Calls", "Gradless", "find_causes", "notes", "sentence", "unused_notes", "watch"]
