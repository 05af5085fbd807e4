"""What the watch reads off the script's model and its run (:mod:`harness.audit.watcher` calls these at each call and
step): the weights and gradients whole (a DTensor gathered), whether a call's backward synchronizes, the model a
sharded block belongs to, a device mesh the audit cannot judge, the dropout it turns off, the label suffixes
``--unbalance`` masks, the autocast dtype in effect."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch import nn

from harness.core.microbatch import IGNORE_INDEX
from harness.model import DROPOUT_SUFFIXES


def unwrap(module: nn.Module) -> nn.Module:
    inner = getattr(module, "module", None)
    return inner if isinstance(inner, nn.Module) and type(module).__name__ == "DistributedDataParallel" else module


def whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor (FSDP2, tp): gathered whole, a collective every rank enters
    return (full() if callable(full) else t).detach()


def flat_weights(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole, in ``parameters()`` order: one flat CPU vector."""
    return torch.cat([whole(p).reshape(-1).cpu() for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, whole (zeros where it has none), in ``parameters()`` order: one flat CPU vector."""
    return torch.cat([(whole(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)).reshape(-1)
                      .cpu() for p in model.parameters()])


def synchronizes(called: nn.Module, model: nn.Module) -> bool | None:
    """Whether this call's backward synchronizes the gradient: DDP's flag, FSDP2's per param group; None where the
    model is wrapped by neither."""
    if called is not model:
        return bool(getattr(called, "require_backward_grad_sync", True))
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if callable(state):
            groups = getattr(state(), "_fsdp_param_groups", None) or []
            if groups:
                return bool(groups[0].reduce_grads)
    return None


def _parent_of(module: nn.Module) -> nn.Module | None:
    """A module whose ``_modules`` holds ``module`` (found through the garbage collector's referrers: the
    ``_modules`` dict, the parent's instance dict, the parent)."""
    for holder in gc.get_referrers(module):
        if not isinstance(holder, dict):
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, nn.Module) and owner.__dict__.get("_modules") is holder:
                return owner
            if isinstance(owner, dict) and owner.get("_modules") is holder:
                found = next((o for o in gc.get_referrers(owner)
                              if isinstance(o, nn.Module) and o.__dict__ is owner), None)
                if found is not None:
                    return found
    return None


def root_of(module: nn.Module) -> nn.Module:
    """The outermost module holding ``module``."""
    current, seen = module, {id(module)}
    while (parent := _parent_of(current)) is not None and id(parent) not in seen:
        seen.add(id(parent))
        current = parent
    return current


DATA_DIMS = frozenset({"dp", "ddp", "data", "dp_replicate", "dp_shard", "replicate", "shard", "fsdp", "hsdp"})
"""Device-mesh dimension names the audit reads as data parallel: every rank of them holds its own batch."""


def mesh_refusal(model: nn.Module, world: int | None = None) -> str | None:
    """Why the audit cannot judge a model whose parameters live on a device mesh with a dimension that is not data
    parallel (:data:`DATA_DIMS`; an unnamed mesh of more than one dimension), or on fewer ranks than the world:
    there the ranks of a group share a batch (tensor, context or pipeline parallelism), and the reference over every
    rank's calls would count it more than once. None where it can (DDP, FSDP2, HSDP over every rank)."""
    import torch.distributed as dist

    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        data = set(names) <= DATA_DIMS if names else mesh.ndim == 1
        if data and mesh.size() == world:
            return None
        shape = " x ".join(f"{n}={k}" for n, k in zip(names, mesh.shape)) if names else str(tuple(mesh.shape))
        return (f"the model's parameters live on a device mesh ({shape}) over {mesh.size()} of {world} ranks: the "
                "audit judges data parallelism over every rank (DDP, FSDP2, HSDP: mesh dimensions named "
                f"{', '.join(sorted(DATA_DIMS))}), where each rank holds its own batch; judge this step as a recipe "
                "with the battery (python -m harness battery --recipe ... --mesh ...)")
    return None


def dropout_off(model: nn.Module) -> Callable[[], None]:
    """Set every dropout probability of ``model`` to 0 (:func:`harness.model.disable_dropout`'s rule); returns the
    function that restores them. Its ``changed`` attribute counts the probabilities that were not 0."""
    saved: list[tuple[object, str, float]] = []

    def zero(obj: object, name: str) -> None:
        value = getattr(obj, name)
        if isinstance(value, float):
            saved.append((obj, name, value))
            setattr(obj, name, 0.0)

    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            zero(module, "p")
        for name in [n for n, v in vars(module).items() if isinstance(v, float) and n.endswith(DROPOUT_SUFFIXES)]:
            zero(module, name)
    config = getattr(model, "config", None)
    if config is not None and not isinstance(config, nn.Module):
        for name in [n for n, v in vars(config).items() if isinstance(v, float) and n.endswith(DROPOUT_SUFFIXES)]:
            zero(config, name)

    def restore() -> None:
        for obj, name, value in saved:
            setattr(obj, name, value)

    restore.changed = sum(v != 0.0 for _, _, v in saved)  # type: ignore[attr-defined]
    return restore


def mask_suffixes(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A copy of ``labels`` [B, T] in which each row keeps a drawn number (1 to all) of its first supervised labels
    and the rest of them are set to -100."""
    out = labels.clone()
    for row in out:
        where = (row != IGNORE_INDEX).nonzero().flatten()
        if len(where) > 1:
            keep = int(torch.randint(1, len(where) + 1, (1,), generator=generator))
            row[where[keep:]] = IGNORE_INDEX
    return out


def autocast_dtype() -> str | None:
    """The dtype autocast computes in right now, on any device type (None: off)."""
    for device in ("cuda", "cpu", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(device):
                return str(torch.get_autocast_dtype(device)).removeprefix("torch.")
        except (RuntimeError, ValueError):  # a device type this build does not know
            continue
    return None


def on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


__all__ = ["DATA_DIMS", "autocast_dtype", "dropout_off", "flat_grads", "flat_weights", "mask_suffixes", "mesh_refusal",
           "on_meta", "root_of", "synchronizes", "unwrap", "whole"]
