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

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.data.config import Config
from harness.model import TinyCausalLM, init_weights
from harness.moe_plan import (
    PLAN_ATTRIBUTE,
    MoePlan,
    expert_parameters,
    plan_of,
    router_parameters,
    unwrapped,
)

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


def routed_sum(layer: MoELayer, flat: torch.Tensor, gates: torch.Tensor, chosen: torch.Tensor,
               experts: Iterable[int], *, call_empty: bool = False) -> torch.Tensor:
    """``sum over k of gates[t, k] * expert_{chosen[t, k]}(flat[t])`` for every token row ``t`` of ``flat``, over the
    experts numbered ``experts`` only (the others contribute nothing). Each expert computes only the rows sent to it.
    ``call_empty``: an expert no row chose is still called, on no rows (a sharded expert gathers its weights in every
    forward, and its gradient, zero, then exists on every rank)."""
    out = torch.zeros_like(flat)
    for e in experts:
        token, slot = (chosen == e).nonzero(as_tuple=True)
        if token.numel() or call_empty:
            # A token appears at most once per expert, so each output row receives one addition per expert, in
            # expert order: the same sum whichever batch the token sits in. The cast keeps autocast's lower
            # precision out of the residual stream's dtype.
            y = layer.experts[e](flat[token]) * gates[token, slot].unsqueeze(1)
            out = out.index_add(0, token, y.to(out.dtype))
    return out


def _mlp(d_model: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))


Dispatch = Callable[["MoELayer", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``dispatch(layer, tokens [n, d], gates [n, k], chosen [n, k]) -> [n, d]``: the routed experts' weighted sum."""


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
        self.gates_carry_grad = True
        """False: the gates reach the experts as plain values (:func:`gates_detached`, the diagnosis's counterfactual
        of a router cut off from the main loss)."""
        self.dispatch: Dispatch | None = None
        """How the routed experts' sum is computed: None, every expert here (:func:`routed_sum`); an
        expert-parallel plan sets a callable ``dispatch(layer, tokens, gates, chosen)`` that sends the tokens to the
        ranks holding their experts and returns the same sum (:mod:`harness.moe_parallel`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(dim=-1)
        top, chosen = probs.topk(self.top_k, dim=-1)
        # Renormalized over the chosen k (Mixtral's norm_topk_prob): a token's expert weights sum to 1 whatever
        # probability the router left on the experts it did not choose.
        gates = top / top.sum(dim=-1, keepdim=True)
        if not self.gates_carry_grad:
            gates = gates.detach()
        out = (routed_sum(self, flat, gates, chosen, range(len(self.experts))) if self.dispatch is None else
               self.dispatch(self, flat, gates, chosen))
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


@contextlib.contextmanager
def gates_detached(model: nn.Module) -> Iterator[None]:
    """Within it, every :class:`MoELayer` of ``model`` weighs its experts' outputs by gates without a gradient: the
    router then learns from its auxiliary terms alone, as when an expert-parallel layer gathers the gates with a
    plain ``all_gather``."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.gates_carry_grad = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gates_carry_grad = True


def router_outputs(model: nn.Module) -> list[RouterOutput]:
    """The router outputs of ``model``'s last forward, ``model`` a :class:`MoECausalLM` or one wrapped by DDP (what
    a recipe's ``auxiliary_loss(model, batch, logits)`` receives)."""
    inner = unwrapped(model)
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


# --- expert parallelism -----------------------------------------------------------------------------------------------


class _GatherRows(torch.autograd.Function):
    """All-gather equal row blocks over ``group`` (rank order), with the gradient: each rank's block feeds every
    rank's experts, so its gradient is the sum over the group of the gathered gradient's block."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, rows.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        n = total.shape[0] // dist.get_world_size(ctx.group)
        me = dist.get_rank(ctx.group)
        return total[me * n:(me + 1) * n], None


class _SumOverGroup(torch.autograd.Function):
    """The sum over ``group`` of each rank's tensor (an all-reduce), with the gradient: every rank's part reaches
    every rank's output, so its gradient is the sum of theirs."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = part.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class ExpertParallel:
    """The dispatch of an expert-parallel :class:`MoELayer` (its :attr:`MoELayer.dispatch`): this rank holds the
    experts numbered ``held``; each forward all-gathers every ep rank's tokens with their gates and choices
    (padded to the longest rank's count), computes its own experts' weighted outputs for every gathered token that
    chose them, and sums the ranks' outputs (an all-reduce), keeping its own tokens' rows: the same sum as
    :func:`routed_sum` over every expert, in another order of additions. Each held expert runs in every forward,
    on no rows if none chose it, so that every ep rank issues the same collectives and a sharded expert's gradient
    exists on every rank. ``gates_with_grad=False`` gathers the gates as plain values (a plain ``all_gather``
    carries no gradient): the router then learns nothing from the main loss through the experts, NeMo Automodel
    PR #2995's mistake, kept as a negative control's plan."""

    def __init__(self, group: Any, held: Sequence[int], *, gates_with_grad: bool = True) -> None:
        self.group = group
        self.held = tuple(held)
        self.gates_with_grad = gates_with_grad

    def __call__(self, layer: MoELayer, flat: torch.Tensor, gates: torch.Tensor,
                 chosen: torch.Tensor) -> torch.Tensor:
        size, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        n, d, k = flat.shape[0], flat.shape[1], chosen.shape[1]
        counts = [torch.zeros(1, dtype=torch.int64, device=flat.device) for _ in range(size)]
        dist.all_gather(counts, torch.tensor([n], dtype=torch.int64, device=flat.device), group=self.group)
        sizes = [int(c) for c in counts]
        most = max(sizes)
        dtype = torch.promote_types(flat.dtype, gates.dtype)
        g = gates if self.gates_with_grad else gates.detach()
        rows = torch.cat([flat.to(dtype), g.to(dtype), chosen.to(dtype)], dim=1)
        rows = torch.cat([rows, rows.new_zeros(most - n, rows.shape[1])])
        every = _GatherRows.apply(rows, self.group)
        valid = torch.cat([torch.arange(r * most, r * most + c, device=flat.device) for r, c in enumerate(sizes)])
        tokens = every[valid, :d].to(flat.dtype)
        their_gates = every[valid, d:d + k]
        their_choice = every[valid, d + k:].detach().round().to(torch.int64)
        mine = routed_sum(layer, tokens, their_gates, their_choice, self.held, call_empty=True)
        padded = mine.new_zeros(size * most, d).index_copy(0, valid, mine)
        total = _SumOverGroup.apply(padded, self.group)
        return total[me * most:me * most + n]


def shard_experts(model: nn.Module, ep_mesh: Any, *, gates_with_grad: bool = True) -> tuple[str, ...]:
    """The built-in expert-parallel plan (``moe.ep_plan``): every :class:`MoELayer` of ``model`` keeps its experts'
    modules, and this rank of ``ep_mesh`` computes the contiguous ``E / ep`` of them at its coordinate (rank 0 of
    ep=2 over E=4: experts 0 and 1), through :class:`ExpertParallel`. Returns the parameter names of the experts this
    rank holds: the others are held elsewhere, and their weights here are never used nor stepped."""
    group, size, me = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
    held: list[str] = []
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        count = len(layer.experts)
        if count % size:
            msg = (f"ep={size} does not divide the {count} experts of {layer.path}: each ep rank holds E/ep whole "
                   "experts; use an ep that divides E")
            raise ValueError(msg)
        per = count // size
        mine = range(me * per, (me + 1) * per)
        layer.dispatch = ExpertParallel(group, mine, gates_with_grad=gates_with_grad)
        held += [f"{layer.path}.experts.{e}.{n}" for e in mine for n, _ in layer.experts[e].named_parameters()]
    if not held:
        msg = "the expert-parallel plan found no MoELayer in the model: --model harness.moe:moe builds one"
        raise ValueError(msg)
    return tuple(held)


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
moe.ep_plan = shard_experts  # type: ignore[attr-defined]


__all__ = [
    "PLAN_ATTRIBUTE",
    "Dispatch",
    "ExpertParallel",
    "MoECausalLM",
    "MoELayer",
    "MoePlan",
    "RouterOutput",
    "build_moe",
    "expert_parameters",
    "gates_detached",
    "load_balancing_loss",
    "moe",
    "plan_of",
    "routed_sum",
    "router_outputs",
    "router_parameters",
    "shard_experts",
]
