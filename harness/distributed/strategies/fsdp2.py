"""FSDP2 (``torch.distributed.fsdp.fully_shard``): every rank holds a shard of each parameter; gradients are
reduce-scattered (averaged over ranks by default, like DDP) after the backward that synchronizes.

The one place the harness shards a model (:func:`groups`): every block of a ``ModuleList`` and every direct child
that owns parameters becomes a ``fully_shard`` group, then the root (the way torchtitan shards per block), unless a
parameter is shared (tied weights): then the root alone, since a parameter cannot live in two groups. The harness
counts synchronizations with its own reduce-scatter (:func:`counting_reduce_scatter`, set on every group): FSDP2
issues one per group in the backward that synchronizes and none under ``set_requires_gradient_sync(False)``, so the
count of backward passes that reduced is what ``one_sync`` judges. Syncing every microbatch gives the same gradients;
only this count sees it. The code under test's calls of the divisor setters are recorded (:meth:`FSDP2Wrapped.notes`
names the modules a factor was set on and those it was not).

The divisor knobs are set on *every* sharded module, never the root alone (the setters do not recurse: a factor set
on the root only leaves every other group averaged): ``reduction="sum"`` sets ``set_gradient_divide_factor(1.0)`` and
``set_force_sum_reduction_for_comms(True)`` (gloo refuses the PREMUL_SUM a factor alone asks for).

A recipe skips a synchronization with ``model.set_requires_gradient_sync(False)`` before the backward of every
microbatch but the last (:func:`harness.recipes.helpers.sync_context` does it for either strategy).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from harness.distributed.strategies.base import register

NO_SYNC = "model.set_requires_gradient_sync(False)"

KNOBS = ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms")
"""FSDP2's per-module divisor setters (neither recurses into the modules below)."""


@functools.cache
def counting_reduce_scatter() -> type:
    """FSDP2's default reduce-scatter, counting (built on first use: importing FSDP costs a second or more, which a
    DDP run should not pay). A backward that synchronizes is the first reduce-scatter after a forward of the root:
    each group reduce-scatters once in it, and the forward that precedes the next backward re-arms the count."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class CountingReduceScatter(DefaultReduceScatter):
        def __init__(self) -> None:
            super().__init__()
            self.syncs = 0
            self.armed = True

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            if self.armed:
                self.syncs += 1
                self.armed = False
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return CountingReduceScatter


def groups(model: nn.Module) -> list[nn.Module]:
    """The modules to shard, innermost first, then the root: every block of a ``ModuleList`` (a transformer's
    layers, wherever they sit) and every direct child that owns parameters and has a forward of its own; the root
    alone when a parameter is shared (tied weights: a parameter cannot live in two groups)."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if len(names) != len(list(model.parameters())):
        return [model]
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.ModuleDict):
            for child_name, child in module.named_children():
                if _owns_parameters(child) and not isinstance(child, nn.ModuleList | nn.ModuleDict):
                    found[f"{name}.{child_name}" if name else child_name] = child
    for name, child in model.named_children():
        if _owns_parameters(child) and not isinstance(child, nn.ModuleList | nn.ModuleDict):
            found.setdefault(name, child)
    inner_first = sorted(found, key=lambda n: -n.count("."))
    return [*(found[n] for n in inner_first), model]


def held_modules(model: nn.Module, names: set[str]) -> list[nn.Module]:
    """The largest modules of ``model`` whose parameters are all named in ``names`` (each held expert), in model
    order."""
    out: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{above}.") for above, _ in out)
        if not inside and _owns_parameters(module) and _all_named(module, model, names, name):
            out.append((name, module))
    return [m for _, m in out]


def _all_named(module: nn.Module, model: nn.Module, names: set[str], prefix: str | None = None) -> bool:
    if prefix is None:
        prefix = next(n for n, m in model.named_modules() if m is module)
    own = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters()]
    return bool(own) and all(n in names for n in own)


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor: gather the shards (a collective)
    return full() if full is not None else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (the tensor itself otherwise)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def sgd_step(model: nn.Module, lr: float) -> None:
    """``p -= lr * p.grad`` for every parameter with a gradient. A sharded parameter whose gradient lies on the same
    mesh with the same placements steps shard by shard, on the local tensors: the elementwise update DTensor's
    ``add_`` runs there, without its sharding propagation, which runs cold in every rank for every parameter shape
    (at ``dp=2,tp=2`` a rank's first step took 0.04 s of CPU through DTensor, 0.0003 s on the shards, with the same
    weights after); any other pair steps through DTensor's ``add_``."""
    with torch.no_grad():
        for p in model.parameters():
            g = p.grad
            if g is None:
                continue
            if _same_layout(p, g):
                local(p).add_(local(g), alpha=-lr)
            else:
                p.add_(g, alpha=-lr)


def _same_layout(p: torch.Tensor, g: torch.Tensor) -> bool:
    mesh, grad_mesh = getattr(p, "device_mesh", None), getattr(g, "device_mesh", None)
    if mesh is None or grad_mesh is None:
        return mesh is None and grad_mesh is None
    return (mesh == grad_mesh and tuple(p.placements) == tuple(g.placements)  # type: ignore[attr-defined]
            and local(p).shape == local(g).shape)


def local_slices(model: nn.Module) -> tuple[tuple[tuple[int, ...], tuple[int, ...]] | None, ...]:
    """Each parameter's local shard on this rank as ``(shape, global offset)``, None for a plain tensor (held whole),
    in model order: the part of the full tensor that ``.to_local()`` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = []
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            out.append(None)
            continue
        shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)  # type: ignore[attr-defined]
        out.append((tuple(shape), tuple(offset)))
    return tuple(out)


class FSDP2Wrapped:
    """One rank's model sharded with ``fully_shard``."""

    def __init__(self, model: nn.Module, device: torch.device, *, reduction: str, count_syncs: bool,
                 mixed_precision: torch.dtype | None, find_unused: bool = False, mesh: Any = None,
                 experts: Any = None) -> None:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        # FSDP2 warns of every module whose forward returns a view (an in-place op on it would skip the pre-backward
        # hook); the harness's loss functions never write into the logits, and the warning would bury its output.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        policy = (MixedPrecisionPolicy() if mixed_precision is None else
                  MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32))
        # A module no forward reaches is never gathered, and FSDP2 cannot accumulate such a group's gradients under
        # a mixed-precision policy with the sync disabled ('FSDPParam' object has no attribute '_unsharded_param'):
        # where parameters may miss a gradient, the whole model is one group, gathered at every forward.
        self.sharded: list[nn.Module] = [model] if find_unused else groups(model)
        ignored: set[nn.Parameter] = set()
        held: list[nn.Module] = []
        if experts is not None:
            # Expert parallelism (torchtitan's layout): each held expert is its own group over the expert-data mesh,
            # summed there and divided by the whole token group's size; the experts held elsewhere are left out.
            if experts.expert_data_mesh is None:
                msg = ("FSDP2 with ep equal to the token group (no expert-data group to shard an expert over) is not "
                       "run yet: use --strategy ddp, or a mesh with dp or dp_shard beside ep (dp_shard=2,ep=2)")
                raise ValueError(msg)
            held = held_modules(model, set(experts.held))
            ignored = experts.elsewhere(model)
            expert_names = set(experts.experts)
            self.sharded = [m for m in self.sharded if m is model or not _all_named(m, model, expert_names)]
            for m in held:
                fully_shard(m, mp_policy=policy, mesh=experts.expert_data_mesh)
                m.set_gradient_divide_factor(experts.divide)  # type: ignore[operator]
                m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        for m in self.sharded:
            fully_shard(m, mp_policy=policy, mesh=mesh, ignored_params=ignored or None)
        self.local: nn.Module = model
        self.module: nn.Module = model
        self.no_sync: str = NO_SYNC
        self._counter: Any = None
        fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if reduction == "sum":
            for m in (m for m in fsdp if m not in held):  # every group: the setters do not recurse
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        self._knobs: dict[str, dict[str, object]] = {}
        named = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        self._names = [n or "the root" for n, _ in named]
        self._record_knobs(named)
        if count_syncs:
            counter = counting_reduce_scatter()()
            for m in fsdp:
                m.set_custom_reduce_scatter(counter)

            def arm(module: nn.Module, args: object) -> None:
                counter.armed = True

            model.register_forward_pre_hook(arm)
            self._counter = counter

    @property
    def syncs(self) -> int:
        return 0 if self._counter is None else self._counter.syncs

    def reset_syncs(self) -> None:
        if self._counter is not None:
            self._counter.syncs = 0
            self._counter.armed = True

    def _record_knobs(self, modules: list[tuple[str, Any]]) -> None:
        """Wrap each sharded module's divisor setters so that the code under test's calls are seen (the harness's
        own, made before, are not): a module that owns no parameter keeps no trace of a factor set on it."""
        for name, m in modules:
            for setter in KNOBS:
                original = getattr(m, setter)

                def record(value: object, *, _name: str = name or "the root", _setter: str = setter,
                           _original: Callable[[object], None] = original) -> None:
                    self._knobs.setdefault(_setter, {})[_name] = value
                    _original(value)

                setattr(m, setter, record)

    def notes(self) -> tuple[str, ...]:
        """The divisor knobs the code under test set on some sharded modules but not on others (the setters do not
        recurse: a factor set on the root alone leaves every group below it averaging)."""
        out = []
        for setter, calls in self._knobs.items():
            missed = [n for n in self._names if n not in calls]
            if missed:
                set_on = ", ".join(f"{n} ({v!r})" for n, v in list(calls.items())[:4])
                out.append(f"the recipe called FSDP2's {setter} on {set_on} but not on {len(missed)} other sharded "
                           f"module(s) ({', '.join(missed[:4])}{' ...' if len(missed) > 4 else ''}): it does not "
                           "recurse, so those still reduce with the default; set it on every fully_shard module, or "
                           "declare reduction = 'sum' on the recipe and let the harness do it")
        return tuple(out)

    def full_grad(self) -> torch.Tensor:
        # Every rank gathers every parameter's gradient, in model order (collectives: every rank calls this alike).
        parts = []
        for p in self.local.parameters():
            parts.append(torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None else
                         _full(p.grad).detach().reshape(-1).cpu())
        return torch.cat(parts) if parts else torch.zeros(0)

    def full_params(self) -> torch.Tensor:
        parts = [_full(p.detach()).reshape(-1).cpu() for p in self.local.parameters()]
        return torch.cat(parts) if parts else torch.zeros(0)


class FSDP2Strategy:
    name = "fsdp2"

    def wrap(self, model: nn.Module, device: torch.device, *, find_unused: bool = False, reduction: str = "mean",
             count_syncs: bool = True, on_comm_hook: Callable[[], None] | None = None,
             mixed_precision: torch.dtype | None = None, mesh: Any = None, experts: Any = None) -> FSDP2Wrapped:
        # find_unused: parameters may miss a gradient; FSDP2 reduce-scatters the gradients that exist, but a group no
        # forward reaches cannot be accumulated, so the model is sharded as one group then (FSDP2Wrapped).
        # on_comm_hook: FSDP2 has no DDP communication hook to take.
        if reduction not in ("mean", "sum"):
            msg = f"reduction={reduction!r} must be 'mean' or 'sum'"
            raise ValueError(msg)
        return FSDP2Wrapped(model, device, reduction=reduction, count_syncs=count_syncs,
                            mixed_precision=mixed_precision, find_unused=find_unused, mesh=mesh, experts=experts)


register(FSDP2Strategy())

__all__ = ["KNOBS", "NO_SYNC", "FSDP2Strategy", "FSDP2Wrapped", "counting_reduce_scatter", "groups", "local",
           "local_slices", "sgd_step"]
