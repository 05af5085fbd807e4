"""The readings of a mixture-of-experts model's gradient by parameter group: its experts, its routers and the rest
(dense), fitted apart.

A mistake in the expert-parallel reduction scales the expert parameters alone: averaged over the expert-data group
instead of divided by the whole data group (DeepSpeed #6545, torchtitan EP with FSDP2, pytorch #160285,
Megatron-FSDP PR #5956), the experts come out ep times too large while every dense tensor is right. One scale
fitted over every parameter reads about 1.01 and hides it, so each group is read against the expected gradient on
its own: where the dense group holds, the experts' common ratio is named by the mesh's fact it equals (ep, the
expert-data group's size, the token group's size). A router whose gradient from the main loss never arrives (its
gates gathered to the expert ranks by a plain ``all_gather``, NeMo Automodel PR #2995) reads as a router group at
its reference recomputed with the gates detached (:func:`router_cut_off`).

The groups come from the model's declaration (``factory.moe_plan``, :class:`harness.moe_plan.MoePlan`); a model
without one is not read here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from harness.core.compare import compare
from harness.core.mesh import Mesh
from harness.diagnosis.fit import match_tolerance
from harness.diagnosis.signatures import Signature
from harness.moe import MoELayer, gates_detached
from harness.moe_plan import MoePlan, expert_parameters, plan_of, router_parameters

RESIDUAL = 1e-3
"""The most a group's relative residual after its common ratio may be for the ratio to be its reading."""


def _mask(names: Sequence[str], sizes: Sequence[int], chosen: set[str]) -> torch.Tensor:
    return torch.cat([torch.full((n,), name in chosen, dtype=torch.bool) for name, n in zip(names, sizes, strict=True)])


def _ratio(g: torch.Tensor, e: torch.Tensor) -> tuple[float, float]:
    """The group's common ratio ``<g, e> / <e, e>`` and its relative residual ``|g - c e| / |g|``."""
    ee = float(e @ e)
    if ee == 0.0:
        return float("nan"), float("nan")
    c = float(g @ e) / ee
    norm = float(g.norm())
    return c, (float((g - c * e).norm()) / norm if norm else 0.0)


def facts(mesh: Mesh) -> dict[str, float]:
    """The mesh's numbers an expert group's ratio may equal, each named: ep (an average over the expert-data group
    where the token group's size belongs leaves W / (W / ep) = ep) and the token group's size W (never divided), and
    their inverses."""
    ep, data = mesh.size("ep"), mesh.token_ranks
    named = {f"ep={ep}": float(ep), f"the token group's size W={data}": float(data)}
    named |= {f"1/{k}": 1.0 / v for k, v in list(named.items())}
    return {k: v for k, v in named.items() if v != 1.0}


def name_factor(c: float, mesh: Mesh) -> str:
    """``c`` named by every fact of the mesh it matches (several when they are equal on this mesh), else the
    number itself."""
    tol = match_tolerance()
    matched = [k for k, v in facts(mesh).items() if abs(c / v - 1) <= tol]
    if not matched:
        return f"{c:.4g}"
    if len(matched) == 1:
        return matched[0]
    return " = ".join(matched) + " (equal on this mesh: a mesh where they differ tells them apart)"


def groups(model_path: str | None, model: torch.nn.Module) -> tuple[set[str], set[str]] | None:
    """The expert and router parameter names of ``model`` from its factory's ``moe_plan`` (None: none declared)."""
    try:
        plan: MoePlan | None = plan_of(model_path)
    except ValueError:
        return None
    if plan is None:
        return None
    return set(expert_parameters(model, plan)), set(router_parameters(model, plan))


def expert_reading(model_path: str | None, model: torch.nn.Module, mesh: Mesh, g: torch.Tensor,
                   expected: torch.Tensor, names: Sequence[str], sizes: Sequence[int], atol: float,
                   rtol: float) -> Signature | None:
    """``experts_scaled`` where the experts alone are off by a common ratio (the dense group and the router right);
    None otherwise."""
    found = groups(model_path, model)
    if found is None:
        return None
    experts, routers = found
    is_expert, is_router = _mask(names, sizes, experts), _mask(names, sizes, routers)
    dense = ~(is_expert | is_router)
    if not compare(g[dense], expected[dense], atol=atol, rtol=rtol).passed:
        return None
    c_exp, r_exp = _ratio(g[is_expert], expected[is_expert])
    router_right = compare(g[is_router], expected[is_router], atol=atol, rtol=rtol).passed
    experts_right = compare(g[is_expert], expected[is_expert], atol=atol, rtol=rtol).passed
    if not experts_right and router_right and r_exp <= RESIDUAL:
        named = name_factor(c_exp, mesh)
        return Signature("experts_scaled", f"the expert parameters' gradients are {c_exp:.4g} times the expected "
                         f"({named}), while every dense tensor and the router are right: the experts' sum over the "
                         f"expert-data group was divided by another number than the token group's size "
                         f"(W={mesh.token_ranks}); averaged over the expert-data group, an expert comes out ep times "
                         "too large", factor=c_exp)
    return None


def router_cut_off(model: torch.nn.Module, g: torch.Tensor, expected: Callable[[], torch.Tensor], atol: float,
                   rtol: float) -> Signature | None:
    """``router_cut_off`` where the gradient is the reference's with every gate detached from the router
    (:func:`harness.moe.gates_detached`; ``expected()`` recomputes the expected gradient, called inside it); None
    otherwise, and for a model without the built-in MoE layers."""
    if not any(isinstance(m, MoELayer) for m in model.modules()):
        return None
    with gates_detached(model):
        cut = expected()
    if not compare(g, cut, atol=atol, rtol=rtol).passed:
        return None
    return Signature("router_cut_off", "the gradient is the reference's with the routing gates detached from the "
                     "router: no gradient of the main loss reached the router (and the layers before it) through the "
                     "gates the experts weighed their outputs by, which were gathered to the expert ranks without "
                     "autograd (a plain all_gather carries none); the router learned from its auxiliary term alone")


__all__ = ["RESIDUAL", "expert_reading", "facts", "groups", "name_factor", "router_cut_off"]
