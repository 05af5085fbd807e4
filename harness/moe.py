"""A small mixture-of-experts causal LM (``--model harness.moe:moe``), what its routers decided on the last forward,
the Switch-style load-balancing term computed from that, and the declaration of which parameters are experts and
which the router (``factory.moe_plan``, the way ``cp_plan`` and ``tp_plan`` are declared).

The model is :class:`harness.model.TinyCausalLM` with the MLP of every block replaced by a :class:`MoELayer`: a linear
router, a softmax over E experts, the top-k of them per token, their probabilities renormalized to sum to 1, and the
token's output the so-weighted sum of its k experts' outputs, plus a shared expert every token goes through. No
capacity limit drops a token and no noise is added to the router: the forward is a fixed function of its inputs and
weights, so the single-device reference computes what the ranks compute. At the battery's size (d_model 32, E=4,
top-2, a shared expert of the experts' width) it has 31,680 parameters (``tests/unit/test_moe.py`` counts them).

This module belongs to the model layer: it imports :mod:`harness.model` and the layers below, never the strategies
that will read its declaration.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.data.config import Config
from harness.model import TinyCausalLM, init_weights, load_model_factory

# --- the router's decisions ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterOutput:
    """What one MoE layer's router decided on the last forward, one row per token of the call (``B * T`` rows, in
    the order of ``x.reshape(-1, d_model)``: row ``b * T + t`` is position ``t`` of row ``b``)."""

    layer: str
    """The MoE layer's module path (``"blocks.0.mlp"``)."""
    probs: torch.Tensor
    """``[tokens, E]``: the softmax of the router's logits over every expert, with autograd (an auxiliary term
    computed from it reaches the router's weights)."""
    chosen: torch.Tensor
    """int64 ``[tokens, k]``: the experts each token was sent to, most probable first."""

    def __post_init__(self) -> None:
        probs, chosen = self.probs, self.chosen
        if probs.dim() != 2 or chosen.dim() != 2 or chosen.shape[0] != probs.shape[0]:
            msg = (f"router output of {self.layer!r}: probs {tuple(probs.shape)} must be [tokens, E] and chosen "
                   f"{tuple(chosen.shape)} [tokens, k] for the same tokens")
            raise ValueError(msg)
        if chosen.dtype != torch.int64 or not 1 <= chosen.shape[1] <= probs.shape[1]:
            msg = (f"router output of {self.layer!r}: chosen must be int64 [tokens, k] with 1 <= k <= E="
                   f"{probs.shape[1]}, got {chosen.dtype} {tuple(chosen.shape)}")
            raise ValueError(msg)

    @property
    def experts(self) -> int:
        return self.probs.shape[1]

    @property
    def top_k(self) -> int:
        return self.chosen.shape[1]


def _mlp(d_model: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))


class MoELayer(nn.Module):
    """Top-k softmax routing over ``experts`` MLPs of width ``hidden``, plus an optional shared expert.

    ``forward(x [..., d_model]) -> [..., d_model]``. Each token is computed only by the experts it was sent to (its
    rows gathered, computed, weighted and added back), so an expert no token of a forward chose gets no gradient
    from it, as in a real MoE: DDP then needs ``find_unused_parameters`` (the battery's model probe finds such a
    parameter and turns it on)."""

    def __init__(self, d_model: int, experts: int = 4, top_k: int = 2, hidden: int | None = None,
                 shared_expert: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            msg = f"top_k={top_k!r} must be between 1 and experts={experts!r}"
            raise ValueError(msg)
        width = 2 * d_model if hidden is None else hidden
        self.top_k = top_k
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(_mlp(d_model, width) for _ in range(experts))
        self.shared = _mlp(d_model, width) if shared_expert else None
        self.routed: RouterOutput | None = None
        """The router's decisions on the last forward (None before one); :meth:`MoECausalLM.router_outputs`."""
        self.path = "mlp"
        """This layer's module path in its model, set by the model that holds it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(dim=-1)
        top, chosen = probs.topk(self.top_k, dim=-1)
        # Renormalized over the chosen k (Mixtral's norm_topk_prob): a token's expert weights sum to 1 whatever
        # probability the router left on the experts it did not choose.
        gates = top / top.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                # A token appears at most once per expert, so each output row receives one addition per expert, in
                # expert order: the same sum whichever batch the token sits in. The cast keeps autocast's lower
                # precision out of the residual stream's dtype.
                y = expert(flat[token]) * gates[token, slot].unsqueeze(1)
                out = out.index_add(0, token, y.to(out.dtype))
        if self.shared is not None:
            out = out + self.shared(flat).to(out.dtype)
        self.routed = RouterOutput(self.path, probs, chosen)
        return out.view_as(x)

    def __getstate__(self) -> dict[str, Any]:
        # The last forward's decisions hold its autograd graph: a copy or a pickle of the model leaves them behind
        # (deepcopy refuses a non-leaf tensor).
        state: dict[str, Any] = super().__getstate__()
        state["routed"] = None
        return state


class MoECausalLM(TinyCausalLM):
    """:class:`harness.model.TinyCausalLM` whose blocks each hold a :class:`MoELayer` as their MLP; the same calls
    (``model(inputs)``, the hf keyword call, ``position_ids``, ``seq_idx``) and the same logits contract."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int = 32, n_layers: int = 1, n_heads: int = 2,
                 dropout: float = 0.0, activation_checkpointing: bool = False, *, experts: int = 4, top_k: int = 2,
                 hidden: int | None = None, shared_expert: bool = True) -> None:
        super().__init__(vocab_size, max_len, d_model, n_layers, n_heads, dropout, activation_checkpointing)
        for i, block in enumerate(self.blocks):
            block.mlp = MoELayer(d_model, experts, top_k, hidden, shared_expert)
            block.mlp.path = f"blocks.{i}.mlp"

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Forget the previous call's decisions first: router_outputs() then never mixes two forwards.
        for layer in self.moe_layers():
            layer.routed = None
        return super().forward(*args, **kwargs)

    def router_outputs(self) -> list[RouterOutput]:
        """Each MoE layer's :class:`RouterOutput` of the last forward, in the order of the blocks. Under activation
        checkpointing a backward recomputes the blocks and replaces them with equal values."""
        outputs = [layer.routed for layer in self.moe_layers()]
        if any(o is None for o in outputs):
            msg = "router_outputs() was called before a forward of this model: call model(inputs) first"
            raise RuntimeError(msg)
        return [o for o in outputs if o is not None]


def router_outputs(model: nn.Module) -> list[RouterOutput]:
    """The router outputs of ``model``'s last forward, ``model`` a :class:`MoECausalLM` or one wrapped by DDP (what
    a recipe's ``auxiliary_loss(model, batch, logits)`` receives)."""
    inner = _unwrapped(model)
    if not isinstance(inner, MoECausalLM):
        msg = (f"router_outputs(model) needs a MoECausalLM (--model harness.moe:moe), got {type(inner).__name__}: "
               "a model of your own exposes its routers' decisions itself")
        raise TypeError(msg)
    return inner.router_outputs()


def load_balancing_loss(outputs: Sequence[RouterOutput], mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch Transformer's load-balancing term of one forward (one microbatch): per MoE layer
    ``E * sum_e f_e * P_e``, where ``f_e`` is the fraction of the tokens' k assignments that went to expert ``e``
    and ``P_e`` the mean router probability of ``e`` over the same tokens, then the mean over the layers. 1 when
    routing is uniform, up to E when it collapses on one expert. Only ``P`` carries a gradient (``f`` counts).

    ``mask`` (bool, one entry per token: ``[B, T]`` of the forward's inputs, or ``[tokens]``): only the tokens where
    it is True count, e.g. ``labels != IGNORE_INDEX`` so that padding, whose share depends on how rows were batched,
    does not move the term. A layer with no token left contributes 0 (connected to its router, so DDP sees it used).
    Under top-k, ``f`` is normalized by ``k`` (its entries sum to 1); Mixtral's loss sums over the k slots instead
    and is k times this.
    """
    if not outputs:
        msg = "load_balancing_loss got no router output: pass model.router_outputs() after a forward of an MoE model"
        raise ValueError(msg)
    if mask is not None and mask.dtype != torch.bool:
        msg = f"mask must be bool (True where a token counts), got {mask.dtype}; e.g. labels != IGNORE_INDEX"
        raise ValueError(msg)
    terms = []
    for out in outputs:
        probs, chosen = out.probs, out.chosen
        if mask is not None:
            if mask.numel() != probs.shape[0]:
                msg = (f"mask {tuple(mask.shape)} has {mask.numel()} entries and {out.layer!r} routed "
                       f"{probs.shape[0]} tokens: pass the mask of the forward's own inputs ([B, T])")
                raise ValueError(msg)
            keep = mask.reshape(-1).to(probs.device)
            probs, chosen = probs[keep], chosen[keep]
        if probs.shape[0] == 0:
            terms.append(out.probs.sum() * 0.0)
            continue
        counts = torch.bincount(chosen.reshape(-1), minlength=out.experts).to(probs.dtype)
        f = counts / chosen.numel()
        terms.append(out.experts * (f * probs.mean(dim=0)).sum())
    return torch.stack(terms).mean()


# --- the declaration -------------------------------------------------------------------------------------------------

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


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (its parameter names carry no ``module.`` prefix); ``model`` otherwise."""
    inner = getattr(model, "module", None)
    return inner if isinstance(model, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module) else model


def _holds(name: str, pattern: str) -> bool:
    parts = name.split(".")[:-1]
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def _select(model: nn.Module, plan: MoePlan, field: str) -> dict[str, nn.Parameter]:
    params = dict(_unwrapped(model).named_parameters())
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


# --- the model the battery ships -------------------------------------------------------------------------------------


def build_moe(config: Config, *, seed: int | None = None, experts: int = 4, top_k: int = 2,
              shared_expert: bool = True) -> MoECausalLM:
    """The MoE model at ``config``'s sizes, its initial weights drawn as the built-in model's
    (:func:`harness.model.init_weights`, seed ``config.seed`` unless given); the global RNG state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        model = MoECausalLM(config.vocab_size, config.max_len, config.d_model, config.n_layers, config.n_heads,
                            config.dropout, experts=experts, top_k=top_k, shared_expert=shared_expert)
    init_weights(model, config.seed if seed is None else seed)
    return model.to(config.dtype)


def moe() -> MoECausalLM:
    """The MoE model at the battery's size (``--model harness.moe:moe``): d_model 32, one block whose MLP is 4
    experts under top-2 routing plus a shared expert. Its initial weights come from the seed the caller set (a
    ``--model`` factory is called right after ``torch.manual_seed``)."""
    return build_moe(Config(dropout=0.0), seed=torch.initial_seed())


moe.moe_plan = MoePlan(experts=("blocks.*.mlp.experts",), router=("blocks.*.mlp.router",))  # type: ignore[attr-defined]


__all__ = [
    "PLAN_ATTRIBUTE",
    "MoECausalLM",
    "MoELayer",
    "MoePlan",
    "RouterOutput",
    "build_moe",
    "expert_parameters",
    "load_balancing_loss",
    "moe",
    "plan_of",
    "router_outputs",
    "router_parameters",
]
