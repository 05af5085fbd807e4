"""torchtitan's own mixture-of-experts decoder as a ``--model``, and torchtitan's own expert parallelism as its
``ep_plan``.

``--model harness.recipes.libraries.torchtitan_moe:torchtitan_moe`` builds a tiny Qwen3-MoE decoder from
torchtitan 0.3's modules (``torchtitan.models.qwen3.model.Qwen3Model`` and its ``TransformerBlock``, the MoE layer
``torchtitan.models.common.moe.MoE``: a ``TokenChoiceTopKRouter`` with softmax scores and Qwen3's ``route_norm``,
``RoutedExperts`` = ``GroupedExperts`` (stacked ``[E, ...]`` SwiGLU weights, ``torch._grouped_mm``) and a token
dispatcher) at the battery's vocabulary and length: d_model 32, 2 heads of 16, one block, 4 experts of width 64,
top-2, no shared expert. Its weights are torchtitan's ``init_states()`` drawn from the generator the caller seeded;
``model(inputs)`` returns logits ``[B, T, V]``: the inner attention is torchtitan's ``ScaledDotProductAttention``
(causal, no mask object), so the decoder takes the tokens alone. No token is dropped: the dispatcher sends every
token to its k experts (torchtitan's standard dispatcher has no capacity), and the auxiliary-loss-free bias is off
(``load_balance_coeff=None``: no ``expert_bias_E``, so the router's choice is a fixed function of its scores).

What differs from torchtitan, and why (each measured, docs/libraries.md "torchtitan's MoE"):

- ``GroupedExperts.forward`` casts the tokens and every expert weight to bfloat16 before ``torch._grouped_mm``, whatever
  the model's dtype (torchtitan trains in bf16). An expert's weight gradient is then a bf16 sum over the tokens
  routed to it, rounded differently when the tokens are split over ranks than on one device: the float32 lane fails
  at bf16 scale. :class:`ModelDtypeExperts` is torchtitan's class with the one change that it computes in the
  weights' dtype (``_grouped_mm`` in float32; a loop of matmuls in float64, which ``_grouped_mm`` refuses). The
  unmodified experts are ``torchtitan_moe_bf16_experts``.
- torchtitan 0.3 imports its CUDA-only MinimalAsyncEP kernels (triton) when ``torchtitan.models.common`` is imported;
  a CPU build of torch ships no triton. Where triton is missing, :func:`_import_torchtitan` registers a stand-in
  for that one subpackage (``torchtitan.distributed.minimal_async_ep``) whose functions raise: nothing here uses it.

The rotary embedding computes in float32 and the combine rounds each expert's output to float32 before weighting it
by the router's score (``routed_output.to(torch.float32) * scores`` in ``token_dispatcher.combine``): the float64 lane
judges the model at float32's tolerances, and passes there.

**Expert parallelism** (``--mesh dp=2,ep=2``): :func:`torchtitan_expert_parallel` is torchtitan's own: each MoE layer's
``RoutedExperts.parallelize`` with the sharding torchtitan declares when ``expert_parallel_degree > 1``
(``torchtitan.models.common.moe_sharding.set_moe_sharding_config(enable_ep=True)``): the stacked expert weights become
DTensors ``Shard(0)`` over the ep mesh (each rank holds E/ep experts as one slice of each parameter), and the
``AllToAllTokenDispatcher`` sends each token to its experts' ranks with ``all_to_all_single`` and back. It runs on
gloo on the CPU. It is given the harness's ep mesh (torchtitan's ``ParallelDims.build_mesh`` builds its meshes on
``torchtitan.tools.utils.device_type``, which is ``"cuda"`` on a CPU-only torch) and runs under torchtitan's
``"partial_dtensor"`` backend (its default, ``"spmd_types"``, needs the trainer's mesh context).

The module imports without torchtitan: building the model then raises naming the install.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import sys
import types
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from harness.data.config import Config
from harness.moe_plan import MoePlan
from harness.recipes.libraries._common import TORCHTITAN_HINT, missing

EXPERT_COMPUTE = ("model", "bf16")
"""How the experts compute: ``"model"``, in the weights' dtype (:class:`ModelDtypeExperts`); ``"bf16"``, torchtitan's
``GroupedExperts`` as it is (bfloat16 whatever the model's dtype)."""

_STANDIN = "torchtitan.distributed.minimal_async_ep"


def _cuda_only(*args: object, **kwargs: object) -> Any:
    msg = ("torchtitan's MinimalAsyncEP token dispatcher needs CUDA and triton; this model uses the standard "
           "all-to-all dispatcher (comm_backend='standard')")
    raise RuntimeError(msg)


def _register_standin() -> None:
    """torchtitan 0.3's ``models.common.token_dispatcher`` imports four names of MinimalAsyncEP, whose module
    imports triton at import time; without triton, register a module with those names that raise when called."""
    if _STANDIN in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    standin = types.ModuleType(_STANDIN, "stand-in for torchtitan's CUDA-only MinimalAsyncEP (no triton here)")
    standin.combine_op = _cuda_only  # type: ignore[attr-defined]
    standin.dispatch_op = _cuda_only  # type: ignore[attr-defined]
    standin.init_buffer = _cuda_only  # type: ignore[attr-defined]
    standin.MinimalAsyncEPDispatchMetadata = type(  # type: ignore[attr-defined]
        "MinimalAsyncEPDispatchMetadata", (), {"__init__": _cuda_only})
    sys.modules[_STANDIN] = standin


_titan: dict[str, Any] = {}


def _import_torchtitan() -> dict[str, Any]:
    """torchtitan's modules this file builds from, imported once; ImportError naming the install without it."""
    if _titan:
        return _titan
    if importlib.util.find_spec("torchtitan") is None:
        raise missing("torchtitan", TORCHTITAN_HINT)
    _register_standin()
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (
        make_gqa_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.moe import GroupedExperts, MoE
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
    from torchtitan.models.qwen3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT

    _titan.update(dist_utils=dist_utils, ParallelDims=ParallelDims, CosSinRoPE=CosSinRoPE, Embedding=Embedding,
                  Linear=Linear, SDPA=ScaledDotProductAttention, make_gqa_config=make_gqa_config,
                  make_moe_config=make_moe_config, make_routed_experts_config=make_routed_experts_config,
                  make_router_config=make_router_config, MoE=MoE, GroupedExperts=GroupedExperts,
                  set_moe_sharding_config=set_moe_sharding_config, RMSNorm=RMSNorm, Qwen3Model=Qwen3Model,
                  Qwen3TransformerBlock=Qwen3TransformerBlock, expert_layout=_GROUPED_EXPERTS_PARAM_LAYOUT)
    _titan["ModelDtypeExperts"] = _model_dtype_experts(GroupedExperts)
    return _titan


def _model_dtype_experts(grouped: type) -> type:
    """:class:`ModelDtypeExperts`, defined once torchtitan is imported (it subclasses torchtitan's class)."""
    from dataclasses import dataclass

    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    class ModelDtypeExperts(grouped):
        """torchtitan's ``GroupedExperts`` computing in its weights' dtype instead of bfloat16: the same SwiGLU
        ``w2(silu(w1 x) * w3 x)`` per expert over the rows sorted by expert, the same DTensor-to-local step under
        expert parallelism."""

        @dataclass(kw_only=True, slots=True)
        class Config(grouped.Config):  # type: ignore[name-defined]
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                          for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
            offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            x = x_RD.to(w1.dtype)
            h = F.silu(self._grouped_mm(A=x, B_t=w1.transpose(-2, -1), offs=offsets))
            h = h * self._grouped_mm(A=x, B_t=w3.transpose(-2, -1), offs=offsets)
            return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offsets).type_as(x_RD)

        def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            if A.dtype != torch.float64:
                return torch._grouped_mm(A, B_t, offs=offs)
            # _grouped_mm takes float32, bf16 and fp16 only: the same product, one expert's rows at a time.
            starts = [0, *offs.tolist()]
            return torch.cat([A[s:e] @ B_t[i] for i, (s, e) in enumerate(itertools.pairwise(starts))])

    ModelDtypeExperts.__module__ = __name__
    return ModelDtypeExperts


def build_torchtitan_moe(config: Config, *, layers: int = 1, experts: int = 4, top_k: int = 2,
                         expert_compute: str = "model") -> nn.Module:
    """The tiny Qwen3-MoE decoder at ``config``'s vocabulary, length and width (``config.d_model``), its weights
    torchtitan's ``init_states()`` drawn from torch's global generator (the caller seeds it)."""
    if expert_compute not in EXPERT_COMPUTE:
        msg = f"expert_compute={expert_compute!r} must be one of {EXPERT_COMPUTE}"
        raise ValueError(msg)
    if layers < 1 or not 1 <= top_k <= experts:
        msg = f"layers={layers!r} must be >= 1 and top_k={top_k!r} between 1 and experts={experts!r}"
        raise ValueError(msg)
    t = _import_torchtitan()
    # The router computes its gate under autocast(float32), which CPU autocast refuses with a warning at every
    # forward; the gate then computes in the model's dtype, as wanted here.
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    dim, heads = config.d_model, 2
    head_dim = dim // heads
    linear: dict[str, Callable[..., Any]] = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}

    def norm(width: int) -> Any:
        return t["RMSNorm"].Config(normalized_shape=width, eps=1e-6, param_init={"weight": nn.init.ones_})

    def block() -> Any:
        routed = t["make_routed_experts_config"](
            dim=dim, hidden_dim=2 * dim, num_experts=experts, top_k=top_k, comm_backend="standard",
            param_init={"w1_EFD": linear["weight"], "w2_EDF": linear["weight"], "w3_EFD": linear["weight"]})
        if expert_compute == "model":
            inner = routed.inner_experts
            routed.inner_experts = t["ModelDtypeExperts"].Config(
                dim=inner.dim, hidden_dim=inner.hidden_dim, num_experts=inner.num_experts,
                param_init=inner.param_init)
        router = t["make_router_config"](dim=dim, num_experts=experts, gate_param_init=linear, top_k=top_k,
                                         score_func="softmax", route_norm=True)
        attention = t["make_gqa_config"](
            dim=dim, n_heads=heads, n_kv_heads=heads, head_dim=head_dim, wqkv_param_init=linear,
            wo_param_init=linear, inner_attention=t["SDPA"].Config(), fuse_qkv=False, qk_norm=norm(head_dim),
            rope=t["CosSinRoPE"].Config(dim=head_dim, max_seq_len=config.max_len, theta=10000.0))
        return t["Qwen3TransformerBlock"].Config(
            attention_norm=norm(dim), ffn_norm=norm(dim), attention=attention,
            moe=t["make_moe_config"](num_experts=experts, router=router, routed_experts=routed,
                                     load_balance_coeff=None))

    model_config = t["Qwen3Model"].Config(
        vocab_size=config.vocab_size, dim=dim, norm=norm(dim), layers=[block() for _ in range(layers)],
        tok_embeddings=t["Embedding"].Config(num_embeddings=config.vocab_size, embedding_dim=dim,
                                             param_init={"weight": partial(nn.init.normal_, std=0.02)}),
        lm_head=t["Linear"].Config(in_features=dim, out_features=config.vocab_size, param_init=linear))
    model = model_config.build()
    model.init_states()
    return model


def torchtitan_expert_parallel(model: nn.Module, ep_mesh: Any) -> tuple[str, ...]:
    """torchtitan's own expert parallelism over ``ep_mesh`` (the model's ``ep_plan``): the sharding torchtitan declares
    for ``expert_parallel_degree > 1`` set on each MoE layer's routed experts, then ``RoutedExperts.parallelize``:
    the stacked weights become DTensors ``Shard(0)`` over ep and the dispatcher exchanges tokens with all-to-all.
    Returns every routed-expert parameter's name: each ep rank holds a shard of each."""
    t = _import_torchtitan()
    size = ep_mesh.size()
    # torchtitan's trainer sets the backend from its config; "partial_dtensor" keeps DTensors to the tp and ep axes.
    t["dist_utils"].set_spmd_backend("partial_dtensor")
    dims = t["ParallelDims"](dp_replicate=1, dp_shard=size, cp=1, tp=1, pp=1, ep=size, world_size=size,
                             spmd_backend="partial_dtensor")
    dims._single_axis_meshes = {"ep": ep_mesh}  # the harness's ep groups, not a mesh build_mesh would make on "cuda"
    held: list[str] = []
    for name, moe in ((n, m) for n, m in model.named_modules() if isinstance(m, t["MoE"])):
        count = moe.routed_experts.inner_experts.num_experts
        if count % size:
            msg = (f"ep={size} does not divide the {count} experts of {name}: torchtitan shards the stacked experts "
                   "on dim 0; use an ep that divides E")
            raise ValueError(msg)
        declared = _sharding_slots()
        t["set_moe_sharding_config"](declared, enable_ep=True, enable_sp=False,
                                     expert_param_layout=t["expert_layout"])
        moe.routed_experts._sharding_config = declared.routed_experts.sharding_config
        moe.routed_experts.inner_experts._sharding_config = declared.routed_experts.inner_experts.sharding_config
        moe.routed_experts.parallelize(dims)
        held += [f"{name}.routed_experts.inner_experts.{p}" for p, _ in
                 moe.routed_experts.inner_experts.named_parameters()]
    if not held:
        msg = "torchtitan_expert_parallel found no torchtitan MoE layer in the model"
        raise ValueError(msg)
    return tuple(held)


def _sharding_slots() -> Any:
    """The parts of an ``MoE.Config`` that ``set_moe_sharding_config`` fills in (a ``sharding_config`` on the MoE,
    its router's gate, its routed experts and their inner experts; no shared expert)."""
    slot = types.SimpleNamespace
    return slot(router=slot(gate=slot()), shared_experts=None, routed_experts=slot(inner_experts=slot()))


MOE_PLAN = MoePlan(experts=("layers.*.moe.routed_experts",), router=("layers.*.moe.router",))
"""torchtitan's layout: ``layers.<i>.moe.routed_experts.inner_experts.w{1,2,3}_E..`` are the experts (stacked),
``layers.<i>.moe.router.gate`` the router."""


def torchtitan_moe() -> nn.Module:
    """The battery's torchtitan MoE (``--model harness.recipes.libraries.torchtitan_moe:torchtitan_moe``): one block, 4
    experts, top-2, the experts computing in the model's dtype."""
    return build_torchtitan_moe(Config(dropout=0.0))


def torchtitan_moe_bf16_experts() -> nn.Module:
    """The same model with torchtitan's ``GroupedExperts`` as it is (bfloat16 expert compute)."""
    return build_torchtitan_moe(Config(dropout=0.0), expert_compute="bf16")


def torchtitan_moe_two_layers() -> nn.Module:
    """Two MoE blocks."""
    return build_torchtitan_moe(Config(dropout=0.0), layers=2)


# Imported with the module where torchtitan is installed: the launcher's forkserver preloads this module before the
# torchtitan modules the model is built from, which then find the stand-in registered (and import in no rank again).
with contextlib.suppress(ImportError):  # without torchtitan, building the model says what to install
    _import_torchtitan()

for _factory in (torchtitan_moe, torchtitan_moe_bf16_experts, torchtitan_moe_two_layers):
    _factory.moe_plan = MOE_PLAN  # type: ignore[attr-defined]
    _factory.ep_plan = torchtitan_expert_parallel  # type: ignore[attr-defined]


__all__ = ["EXPERT_COMPUTE", "MOE_PLAN", "build_torchtitan_moe", "torchtitan_expert_parallel", "torchtitan_moe",
           "torchtitan_moe_bf16_experts", "torchtitan_moe_two_layers"]
