"""The declaration of a mixture-of-experts model's parts: which parameters are experts and which its routers
(``factory.moe_plan``, a :class:`MoePlan`, declared beside a ``--model`` factory the way ``cp_plan`` and ``tp_plan``
are), and the lookups that read it. Re-exported by :mod:`harness.moe`; pure declaration, no model here.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from harness.model import load_model_factory

PLAN_ATTRIBUTE = "moe_plan"
"""The attribute of a ``--model`` factory that declares its experts and routers: a :class:`MoePlan`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MoePlan:
    """Which parameters of a mixture-of-experts model are experts and which its routers, by module path pattern
    (``fnmatch``: ``*`` matches any text, dots included). A parameter belongs to a pattern when the module that holds
    it, or any module above it, matches: ``"blocks.*.mlp.experts"`` takes every parameter of every expert. A shared
    expert is neither: like the rest of the model, it is replicated on every data-parallel rank."""

    experts: tuple[str, ...]
    """Patterns of the experts' modules (their parameters may be sharded over an expert-parallel group)."""
    router: tuple[str, ...]
    """Patterns of the routers' modules (replicated, reduced like the rest of the model)."""

    def __post_init__(self) -> None:
        for field in ("experts", "router"):
            value = getattr(self, field)
            if not (isinstance(value, tuple) and value and all(isinstance(p, str) and p for p in value)):
                msg = (f"MoePlan.{field}={value!r} must be a non-empty tuple of module path patterns, e.g. "
                       f"{field}=('blocks.*.mlp.{'experts' if field == 'experts' else 'router'}',)")
                raise ValueError(msg)


def plan_of(model_path: str | None) -> MoePlan | None:
    """The :class:`MoePlan` a ``--model`` factory declares (None: none declared, or the built-in model)."""
    if model_path is None:
        return None
    plan = getattr(load_model_factory(model_path), PLAN_ATTRIBUTE, None)
    if plan is not None and not isinstance(plan, MoePlan):
        msg = (f"model={model_path!r}: its {PLAN_ATTRIBUTE} is a {type(plan).__name__}, not a harness.moe.MoePlan; "
               f"declare factory.{PLAN_ATTRIBUTE} = MoePlan(experts=(...), router=(...))")
        raise ValueError(msg)
    return plan


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (its parameter names carry no ``module.`` prefix); ``model`` otherwise."""
    inner = getattr(model, "module", None)
    return inner if isinstance(model, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module) else model


def _holds(name: str, pattern: str) -> bool:
    parts = name.split(".")[:-1]
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def _select(model: nn.Module, plan: MoePlan, field: str) -> dict[str, nn.Parameter]:
    params = dict(unwrapped(model).named_parameters())
    modules = sorted({n.rsplit(".", 1)[0] for n in params if "." in n})
    for pattern in getattr(plan, field):
        if not any(_holds(n, pattern) for n in params):
            shown = ", ".join(modules[:8]) + (f" and {len(modules) - 8} more" if len(modules) > 8 else "")
            msg = (f"{PLAN_ATTRIBUTE}.{field} pattern {pattern!r} matches no parameter of the model; name the "
                   f"modules that hold them by their path (fnmatch, '*' for an index): the model's modules with "
                   f"parameters are {shown}")
            raise ValueError(msg)
    other = "router" if field == "experts" else "experts"
    picked = {n: p for n, p in params.items() if any(_holds(n, pat) for pat in getattr(plan, field))}
    both = [n for n in picked if any(_holds(n, pat) for pat in getattr(plan, other))]
    if both:
        msg = (f"{PLAN_ATTRIBUTE} names {both[0]!r} both as an expert and as a router parameter "
               f"(experts={plan.experts!r}, router={plan.router!r}): make the patterns disjoint")
        raise ValueError(msg)
    return picked


def expert_parameters(model: nn.Module, plan: MoePlan) -> dict[str, nn.Parameter]:
    """The parameters ``plan`` names experts, by name, in the model's order; ValueError naming the pattern and the
    fix for a pattern that matches no parameter, or a parameter named both expert and router."""
    return _select(model, plan, "experts")


def router_parameters(model: nn.Module, plan: MoePlan) -> dict[str, nn.Parameter]:
    """The parameters ``plan`` names routers, by name, in the model's order; errors as :func:`expert_parameters`."""
    return _select(model, plan, "router")


__all__ = ["PLAN_ATTRIBUTE", "MoePlan", "expert_parameters", "plan_of", "router_parameters", "unwrapped"]
