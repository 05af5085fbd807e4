"""Helpers a recipe may use (none is required: ``examples/token_mean_recipe.py`` is correct without them).

The three places where recipes go wrong without noticing, each in one line:

- :func:`global_count`: the window's supervised count summed over every rank (the one denominator), on the device
  the backend needs, also without a process group (a single process is the whole world);
- :func:`sync_context`: the ``no_sync()`` decision for microbatch ``i`` of ``n`` (all but the last skip the
  all-reduce; forward and backward both belong inside it);
- :func:`require_tokens`: the contract's ``ValueError`` when the *global* count is zero, raised on every rank with
  the same message, so no rank is left waiting in a collective (a guard on the local count hangs its peers).

::

    total = require_tokens(global_count(sum(supervised_tokens(mb) for mb in window)))
    for i, mb in enumerate(window):
        with sync_context(model, i, len(window)):
            (loss_sum_of(model, mb) * world_size / total).backward()
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from harness.core.formats import supervised_tokens
from harness.core.loss import check_global_count, count_device, global_count
from harness.core.mesh import DATA_DIMS, TOKEN_DIMS
from harness.distributed.device_mesh import flattened


def sync_context(model: nn.Module, i: int, n: int) -> contextlib.AbstractContextManager[object]:
    """Skip the gradient synchronization of microbatch ``i < n - 1`` of a window of ``n``; let the last one (the one
    that synchronizes) through. Under DDP that is ``model.no_sync()``; under FSDP2 (a ``fully_shard`` model)
    ``model.set_requires_gradient_sync(False)`` for the pass, restored after it; a null context for a model with
    neither (no data-parallel wrapper). Forward and backward both belong inside it."""
    if isinstance(i, bool) or isinstance(n, bool) or not isinstance(i, int) or not isinstance(n, int) \
            or not 0 <= i < n:
        msg = f"sync_context(model, i={i!r}, n={n!r}): i must be a microbatch index 0 <= i < n"
        raise ValueError(msg)
    if i == n - 1:
        return contextlib.nullcontext()
    no_sync = getattr(model, "no_sync", None)
    if no_sync is not None:
        return no_sync()
    if callable(getattr(model, "set_requires_gradient_sync", None)):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    # FSDP2 reads the flag when the backward reaches each group, so it must still be False then; the next
    # microbatch's pass (the last one's, which synchronizes) sees it True again.
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip every parameter's gradient to the total norm ``max_norm`` after the synchronization, and return the norm
    before clipping, as a float, under either strategy: ``torch.nn.utils.clip_grad_norm_`` over every parameter (under
    FSDP2 the gradients are sharded DTensors, and the norm it returns is the global one, replicated).

    Under tensor parallelism some gradients may live on the 2-D (dp, tp) mesh and others on dp alone (a plan that
    leaves a module unsharded), and ``clip_grad_norm_`` then raises "All operands in aten.stack.default must have
    the same mesh" (torch 2.13). There the norm is each gradient's own norm made whole (``full_tensor()`` reduces
    over the dimensions it is sharded on, and only those), squared and summed: the norm of the full gradient."""
    import torch

    params = [p for p in model.parameters() if p.grad is not None]
    meshes = {m for m in (getattr(p.grad, "device_mesh", None) for p in params) if m is not None}
    if len(meshes) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)
    squares = torch.zeros((), dtype=torch.float64)
    for p in params:
        n = torch.linalg.vector_norm(p.grad, 2.0)
        whole = getattr(n, "full_tensor", None)
        squares += (whole() if whole is not None else n).detach().double().cpu() ** 2
    total = float(squares.sqrt())
    coef = min(1.0, max_norm / (total + 1e-6))  # clip_grad_norm_'s own factor
    with torch.no_grad():
        for p in params:
            p.grad.mul_(coef)  # type: ignore[union-attr]
    return total


def require_tokens(global_count: int) -> int:
    """Return ``global_count``, or raise the contract's ``ValueError`` when it is zero.

    Give it the *global* count (:func:`global_count`): every rank then holds the same number, so every rank raises
    the same message together and none is left in a collective. Call it before any forward or backward, so that a
    refused window leaves no gradient behind.
    """
    check_global_count(global_count)
    return int(global_count)


def global_sum(value: float, group: Any = None) -> float:
    """All-reduce (SUM) a float in float64 on the count device, over ``group`` (None: every rank); the identity outside
    a process group."""
    if not dist.is_initialized():
        return value
    t = torch.tensor(value, dtype=torch.float64, device=count_device())
    dist.all_reduce(t, group=group)
    return float(t)


@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """Python's, numpy's and torch's global generators (CUDA's where initialized) as they were before the block: what
    a library constructor that seeds them (``Trainer.__init__``'s ``set_seed``) leaves moved, put back."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


__all__ = ["clip_grad_norm", "generators_kept", "global_count", "global_sum", "require_tokens", "supervised_tokens",
           "sync_context"]


def token_group(mesh: Any) -> Any:
    """The process group a window's supervised count must be all-reduced over on ``mesh`` (the torch ``DeviceMesh``
    the harness passes a recipe that takes ``mesh``): its data-parallel and cp dimensions, flattened where several.
    Each supervised token lies in exactly one of their coordinates; tp and pp ranks hold the same tokens, so a count
    over them counts a token once per replica. None (no mesh): None, every rank."""
    if mesh is None:
        return None
    return flattened(mesh, _token_dims(mesh)).get_group()


def token_group_size(mesh: Any) -> int:
    """How many ranks :func:`token_group` spans: the factor that undoes the gradient's average over that group (the
    ``world_size`` of :func:`harness.global_token_loss` on a mesh). No mesh: the world size."""
    if mesh is None:
        return dist.get_world_size() if dist.is_initialized() else 1
    return int(flattened(mesh, _token_dims(mesh)).size())


def data_group(mesh: Any) -> Any:
    """The process group whose ranks hold distinct microbatches on ``mesh``: its data-parallel dimensions, flattened
    where several (cp excluded: every cp rank of a data coordinate runs that coordinate's microbatches, supervised on
    its own chunk of their positions). A term with one value per microbatch (a router's load-balancing loss) is
    averaged over this group's microbatches, not over the token group's. None (no mesh): None, every rank; a mesh
    without a data-parallel dimension: ValueError naming it (use :func:`data_group_size`, 1 there)."""
    if mesh is None:
        return None
    return flattened(mesh, _data_dims(mesh)).get_group()


def data_group_size(mesh: Any) -> int:
    """How many ranks :func:`data_group` spans: the data-parallel size, 1 on a mesh without a data-parallel dimension.
    No mesh: the world size."""
    if mesh is None:
        return dist.get_world_size() if dist.is_initialized() else 1
    dims = tuple(n for n in mesh.mesh_dim_names if n in DATA_DIMS)
    return int(flattened(mesh, dims).size()) if dims else 1


def shard_group(mesh: Any) -> Any:
    """The process group FSDP2 shards a parameter over on ``mesh``: :func:`token_group` less ``dp_replicate`` (under
    HSDP each replica holds every shard once, so a gradient norm's squared shard norms are summed over this group
    only; summed over the replicas too, the norm is sqrt(dp_replicate) too large). Without ``dp_replicate``: the
    token group. None (no mesh): None, every rank."""
    if mesh is None:
        return None
    dims = tuple(d for d in _token_dims(mesh) if d != "dp_replicate")
    if not dims:
        msg = (f"mesh={tuple(mesh.mesh_dim_names)!r} has no dimension to shard over besides dp_replicate: each "
               "rank holds whole parameters, and a norm needs no reduction")
        raise ValueError(msg)
    return flattened(mesh, dims).get_group()


def expert_data_group(mesh: Any) -> Any:
    """The process group an expert parameter's gradient is summed over on ``mesh`` (a mesh with ``ep``): the token
    group less ep, the ranks holding the same experts. None where that is this rank alone (ep is the whole token
    group): there is nothing to sum, only :func:`expert_divide_factor` to divide by."""
    dims = tuple(d for d in _token_dims(mesh) if d != "ep")
    return flattened(mesh, dims).get_group() if dims else None


def expert_divide_factor(mesh: Any) -> int:
    """What an expert parameter's sum over :func:`expert_data_group` is divided by: the whole token group's size
    (:func:`token_group_size`), as the dense parameters' average divides, never the expert-data group's own size
    (which leaves the experts ep times too large: DeepSpeed #6545)."""
    return token_group_size(mesh)


def held_experts(model: nn.Module) -> list[nn.Parameter]:
    """The expert parameters this rank holds under expert parallelism (the model's ``ep_plan`` chose them), in model
    order: what a recipe that reduces the experts itself (``reduces_experts = True``) sums over
    :func:`expert_data_group`. ValueError on a model that is not expert-parallel."""
    inner = getattr(model, "module", model) if not hasattr(model, "expert_layout") else model
    layout = getattr(inner, "expert_layout", None)
    if layout is None:
        msg = ("held_experts(model): the model is not expert-parallel (no ep dimension in the mesh, or no ep_plan): "
               "run over --mesh dp=2,ep=2 with --model harness.moe:moe")
        raise ValueError(msg)
    return list(layout.held_parameters(inner))


def _data_dims(mesh: Any) -> tuple[str, ...]:
    dims = tuple(n for n in mesh.mesh_dim_names if n in DATA_DIMS)
    if not dims:
        msg = (f"mesh={tuple(mesh.mesh_dim_names)!r} has no data-parallel dimension ({', '.join(DATA_DIMS)}): every "
               "rank runs the same microbatches, and there is no group to average them over")
        raise ValueError(msg)
    return dims


def _token_dims(mesh: Any) -> tuple[str, ...]:
    dims = tuple(n for n in mesh.mesh_dim_names if n in TOKEN_DIMS)
    if not dims:
        msg = (f"mesh={tuple(mesh.mesh_dim_names)!r} has no data-parallel or cp dimension "
               f"({', '.join(TOKEN_DIMS)}): a count has no group to be reduced over")
        raise ValueError(msg)
    return dims
