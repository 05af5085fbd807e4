"""Expert parallelism on a rank: the plan that spreads a mixture-of-experts model's experts over the mesh's ``ep``
dimension, the groups its gradients reduce over, and the gather of the full gradient for the comparison.

A run over ``--mesh dp=2,ep=2`` has 4 data ranks; each ep rank computes ``E / ep`` of the experts (the model's
``ep_plan``, :func:`harness.moe.shard_experts` for the built-in model: its dispatch sends every token to the ranks
holding its experts and sums their outputs back). Then:

- **dense parameters** (everything the model's ``moe_plan`` does not name an expert: attention, norms, router, shared
  expert) are replicated on every data rank and reduce over the whole token group, dp x ep (x cp), averaged;
- **expert parameters** exist on the ep ranks that hold them; each is summed over the **expert-data group** (the
  token dimensions less ep: the ranks holding the same experts) and divided by the size of the *whole* token group
  (:attr:`harness.core.mesh.Mesh.expert_data_dims`), because an expert's gradient is a term of the same mean over
  every token. Divided by the expert-data group's own size instead (DeepSpeed #6545, torchtitan EP with FSDP2,
  pytorch #160285), expert gradients come out ep times too large while the dense ones are right.

Under DDP the harness's DDP ignores the expert parameters and :class:`ExpertReducer` sums them over the expert-data
group at the end of the backward that synchronizes (the same forward-time decision as DDP's: outside ``no_sync()``);
under FSDP2 the held experts are ``fully_shard`` groups over the expert-data mesh with that divide factor, as
torchtitan shards them. A recipe that reduces the expert gradients itself, as DeepSpeed's and Megatron's engines do,
declares ``reduces_experts = True`` (DDP only): the harness then leaves them as each rank computed them.

A user's model declares, beside its factory, ``factory.moe_plan`` (which parameters are experts:
:class:`harness.moe.MoePlan`) and ``factory.ep_plan``, a callable ``plan(model, ep_mesh)`` that makes the model
expert-parallel in place and returns the names of the expert parameters this rank holds. A recipe with its own
expert-parallel layer declares its own ``ep_plan``, applied instead of the model's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from harness.model import ModelError, load_model_factory
from harness.moe_plan import PLAN_ATTRIBUTE as MOE_PLAN
from harness.moe_plan import MoePlan, expert_parameters

PLAN_ATTRIBUTE = "ep_plan"
"""The attribute of a ``--model`` factory (or a recipe) holding its expert-parallel plan:
``plan(model, ep_mesh) -> names of the expert parameters this rank holds``."""

OWNS_REDUCTION = "reduces_experts"
"""The recipe attribute that says it reduces the expert gradients itself (True)."""


@dataclass(frozen=True)
class ExpertLayout:
    """One rank's experts: every expert parameter's name, the ones held here, the process groups of ``ep`` and of
    the expert-data group (None when it is this rank alone), its ``DeviceMesh`` (FSDP2 shards over it), and what an
    expert gradient's sum is divided by (the token group's size under a mean; 1 under a summing reduction)."""

    experts: tuple[str, ...]
    held: tuple[str, ...]
    ep_group: Any
    expert_data_group: Any
    expert_data_mesh: Any
    divide: float
    reduced_by_recipe: bool = False
    sharded: tuple[str, ...] = ()
    """The held expert parameters that are DTensors sharded over ep (torchtitan's layout: a stacked ``[E, ...]``
    weight ``Shard(0)``, each ep rank holding E/ep experts as a slice of the one parameter); the others in
    :attr:`held` are held whole by this rank alone."""

    def held_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        named = dict(model.named_parameters())
        return [named[n] for n in self.held]

    def elsewhere(self, model: nn.Module) -> set[nn.Parameter]:
        """The expert parameters other ep ranks hold (never used nor stepped here)."""
        held = set(self.held)
        return {p for n, p in model.named_parameters() if n in self.experts and n not in held}


def plans_of(model_path: str | None, recipe: object = None) -> tuple[MoePlan, Any]:
    """The ``moe_plan`` and ``ep_plan`` a run over ``ep > 1`` needs (the recipe's ``ep_plan`` first); ModelError
    naming what to declare otherwise."""
    factory = None if model_path is None else load_model_factory(model_path)
    moe_plan = getattr(factory, MOE_PLAN, None)
    ep_plan = getattr(recipe, PLAN_ATTRIBUTE, None) or getattr(factory, PLAN_ATTRIBUTE, None)
    if not isinstance(moe_plan, MoePlan) or not callable(ep_plan):
        name = "the built-in model" if model_path is None else f"model={model_path!r}"
        msg = (f"{name} runs over a mesh with ep > 1 but has no mixture-of-experts declaration: run "
               "--model harness.moe:moe, or declare beside your factory moe_plan = harness.moe.MoePlan(experts=..., "
               "router=...) and ep_plan, a callable plan(model, ep_mesh) that makes the model expert-parallel and "
               "returns the names of the expert parameters the rank holds (docs/your-model.md)")
        raise ModelError(msg)
    return moe_plan, ep_plan


def apply_plan(model: nn.Module, model_path: str | None, rank_mesh: Any, recipe: object = None,
               reduction: str = "mean") -> ExpertLayout:
    """Make ``model`` expert-parallel over the ep dimension of ``rank_mesh`` (a
    :class:`harness.distributed.device_mesh.RankMesh`) and return this rank's :class:`ExpertLayout`. ValueError when
    the plan's held names are not expert parameters, or when an expert is held by no ep rank or by several."""
    moe_plan, ep_plan = plans_of(model_path, recipe)
    experts = tuple(expert_parameters(model, moe_plan))
    held = tuple(ep_plan(model, rank_mesh.submesh(("ep",))))
    stray = [n for n in held if n not in experts]
    if stray:
        msg = (f"ep_plan returned {stray[0]!r} as a held expert parameter, but moe_plan.experts does not name it "
               f"(experts: {', '.join(experts[:4])}{' ...' if len(experts) > 4 else ''}): make the two agree")
        raise ValueError(msg)
    ep_group = rank_mesh.group(("ep",))
    sharded = _sharded_over(model, held, ep_group)
    holders = torch.tensor([float(n in held) for n in experts], dtype=torch.float64)
    dist.all_reduce(holders, group=ep_group)
    ep = dist.get_world_size(ep_group)
    wrong = [(n, int(c)) for n, c in zip(experts, holders.tolist(), strict=True) if c != (ep if n in sharded else 1)]
    if wrong:
        msg = (f"ep_plan: expert parameter {wrong[0][0]!r} is held by {wrong[0][1]} ep ranks; each must be held by "
               "exactly one rank of the ep group, or be a DTensor sharded over the ep mesh that every ep rank holds "
               "a shard of")
        raise ValueError(msg)
    dims = rank_mesh.mesh.expert_data_dims
    edp = rank_mesh.submesh(dims) if dims and rank_mesh.mesh.token_ranks > rank_mesh.mesh.size("ep") else None
    layout = ExpertLayout(
        experts=experts, held=held, ep_group=ep_group,
        expert_data_group=None if edp is None else edp.get_group(), expert_data_mesh=edp,
        divide=float(rank_mesh.mesh.token_ranks) if reduction == "mean" else 1.0,
        reduced_by_recipe=bool(getattr(recipe, OWNS_REDUCTION, False)), sharded=sharded,
    )
    setattr(model, "expert_layout", layout)  # noqa: B010 (what harness.recipes.held_experts reads)
    return layout


def _sharded_over(model: nn.Module, held: Sequence[str], ep_group: Any) -> tuple[str, ...]:
    """The held expert parameters that are DTensors sharded over the ep group (ValueError for a DTensor expert on
    another mesh or replicated: the harness cannot tell which rank holds what)."""
    named = dict(model.named_parameters())
    ep_ranks = sorted(dist.get_process_group_ranks(ep_group))
    out = []
    for name in held:
        p = named[name]
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
        if mesh.ndim != 1 or ranks != ep_ranks or not any(pl.is_shard() for pl in p.placements):
            msg = (f"ep_plan: expert parameter {name!r} is a DTensor {tuple(p.placements)} over ranks {ranks}; a "
                   f"DTensor expert must be sharded over the ep mesh alone (ranks {ep_ranks}), e.g. Shard(0) of a "
                   "stacked [E, ...] weight")
            raise ValueError(msg)
        out.append(name)
    return tuple(out)


class ExpertReducer:
    """Under DDP: the held experts' gradients summed over the expert-data group and divided by
    :attr:`ExpertLayout.divide`, once, at the end of every backward whose forward ran outside ``no_sync()`` (DDP's
    own rule: the forward decides). Queued as an autograd callback from the first held expert's gradient, so it runs
    after every gradient of that backward is accumulated; every held expert takes part in every forward
    (:class:`harness.moe.ExpertParallel` runs an expert on no rows), so every rank queues it alike."""

    def __init__(self, ddp: nn.Module, params: Sequence[nn.Parameter], layout: ExpertLayout) -> None:
        self.params = list(params)
        self.layout = layout
        self.armed = False
        self.queued = False
        ddp.register_forward_pre_hook(self._arm)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _arm(self, module: nn.Module, args: object) -> None:
        # A forward without gradients (an evaluation between a forward and its backward) decides nothing, as in DDP.
        if torch.is_grad_enabled():
            self.armed = bool(getattr(module, "require_backward_grad_sync", True))

    def _ready(self, param: torch.Tensor) -> None:
        if self.armed and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.reduce)

    def reduce(self) -> None:
        self.queued = False
        sum_and_divide(self.params, self.layout.expert_data_group, self.layout.divide)


def sum_and_divide(params: Sequence[nn.Parameter], group: Any, divide: float) -> None:
    """Every gradient of ``params`` (zero where there is none) summed over ``group`` in one flat all-reduce (none
    when ``group`` is None: this rank alone) and divided by ``divide``. A DTensor parameter's gradient is this
    rank's shard of it: the shards of the ranks that hold the same experts are summed, and the gradient stays a
    DTensor of the parameter's placements."""
    grads = [torch.zeros_like(_local(p)) if p.grad is None else _local(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat /= divide
    offset = 0
    for p, g in zip(params, grads, strict=True):
        value = flat[offset:offset + g.numel()].view_as(g).clone()
        p.grad = (DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                     stride=p.stride()) if isinstance(p, DTensor) else value)
        offset += g.numel()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full_flat(model: nn.Module, *, grads: bool) -> torch.Tensor:
    """Every parameter's full value (or gradient: zeros where there is none), in model order, one flat CPU vector;
    a DTensor's shards gathered (a collective over its mesh: every rank calls this alike)."""
    parts = []
    # FSDP2 over an ep-sharded expert makes a 2-D DTensor (_StridedShard, Shard) that torch gathers in two steps,
    # with a warning per rank that the steps cannot be merged: true, and of no consequence to a comparison.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        for p in model.parameters():
            t = p if not grads else (torch.zeros_like(p) if p.grad is None else p.grad)
            t = t.full_tensor() if isinstance(t, DTensor) else t
            parts.append(t.detach().reshape(-1).cpu())
    finally:
        log.setLevel(level)
    return torch.cat(parts)


def gather_experts(flat: torch.Tensor, model: nn.Module, layout: ExpertLayout) -> torch.Tensor:
    """``flat`` (every parameter's full value or gradient in model order, as this rank sees it) with every expert
    parameter's entries taken from the ep rank that holds it (an all-reduce over ep of the held entries, the others
    zero): what the comparison reads on every rank. A DTensor expert sharded over ep (:attr:`ExpertLayout.sharded`)
    comes whole in ``flat`` already (its shards gathered) and is left as it is."""
    held, sharded = set(layout.held), set(layout.sharded)
    spans, offset = [], 0
    for name, p in model.named_parameters():
        if name in layout.experts and name not in sharded:
            spans.append((offset, p.numel(), name in held))
        offset += p.numel()
    if not spans:
        return flat
    experts = torch.cat([flat[o:o + n] if mine else torch.zeros(n, dtype=flat.dtype) for o, n, mine in spans])
    dist.all_reduce(experts, group=layout.ep_group)
    out, at = flat.clone(), 0
    for o, n, _ in spans:
        out[o:o + n] = experts[at:at + n]
        at += n
    return out


class ExpertParallelWrapped:
    """A strategy's wrapped model with its experts spread over ep: everything as the strategy's, with the full
    gradient and parameters read from the ranks that hold each expert."""

    def __init__(self, inner: Any, layout: ExpertLayout) -> None:
        self.inner = inner
        self.layout = layout
        self.module = inner.module
        self.local = inner.local
        self.no_sync = inner.no_sync

    @property
    def syncs(self) -> int:
        return int(self.inner.syncs)

    def reset_syncs(self) -> None:
        self.inner.reset_syncs()

    def notes(self) -> tuple[str, ...]:
        return tuple(self.inner.notes())

    def full_grad(self) -> torch.Tensor:
        # With DTensor experts the strategy's own flat (DDP's reads every .grad as a plain tensor) cannot hold them:
        # every parameter is read here, each DTensor's shards gathered.
        flat = full_flat(self.local, grads=True) if self.layout.sharded else self.inner.full_grad()
        return gather_experts(flat, self.local, self.layout)

    def full_params(self) -> torch.Tensor:
        flat = full_flat(self.local, grads=False) if self.layout.sharded else self.inner.full_params()
        return gather_experts(flat, self.local, self.layout)


__all__ = ["OWNS_REDUCTION", "PLAN_ATTRIBUTE", "ExpertLayout", "ExpertParallelWrapped", "ExpertReducer",
           "apply_plan", "full_flat", "gather_experts", "plans_of", "sum_and_divide"]
