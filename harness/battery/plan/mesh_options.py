"""The mesh's options as every surface declares them: ``--mesh``, ``--cp-chunking``, and a pipeline's ``--pp-schedule``,
``--pp-steps`` and ``--pp-microbatches``, each with one help text and one validation, and which strategy wraps a
model over a mesh (re-exported by :mod:`harness.battery.plan.options`, which parses them with the rest). Pure Python."""

from __future__ import annotations

from collections.abc import Sequence

from harness.core.mesh import PP_SCHEDULES, REFUSED_PP_SCHEDULES, TOKEN_DIMS, Mesh

MESH_HELP = ("the mesh the battery's cases run over, e.g. dp=2,cp=2 (the sizes of pp, dp, or dp_replicate and "
             "dp_shard, ep, cp and tp: their product is the world size; repeatable; default: dp=W at each world size); "
             "each cp rank is supervised on its chunk of its data coordinate's positions; tp shards the model (under "
             "--strategy fsdp2 only) and its ranks get their coordinate's data; pp splits the model into stages "
             "(with dp only; each stage DDP or FSDP2 over dp), every stage getting its coordinate's whole window; ep "
             "ranks get distinct windows and each computes E/ep of a mixture-of-experts model's experts (a --model "
             "with an ep_plan, e.g. harness.moe:moe)")
"""``--mesh``'s help, the same on the command line and in pytest."""

CHUNKING_HELP = ("how the cp ranks of one data coordinate split its sequences' positions: contiguous (cp chunks in "
                 "order, default) or load_balanced (2cp chunks, rank i holding chunks i and 2cp-1-i, as torch's "
                 "context_parallel and Megatron-LM cut them)")
"""``--cp-chunking``'s help, the same on every surface."""

PP_SCHEDULE_HELP = ("the torch.distributed.pipelining schedule a recipe's pipeline.schedule() builds over pp: gpipe "
                    "(default: every microbatch's forward, then every backward), 1f1b (one forward, one backward in "
                    "steady state), interleaved1f1b (1f1b over 2 stages per rank, depth first) or loopedbfs (2 stages "
                    "per rank, breadth first: each local stage runs all its microbatches before the next); under the "
                    "interleaved ones the model is cut into pp*2 stages, rank r holding stages r and r+pp; "
                    "interleavedzb is refused (its split weight backward reduces no gradient over dp): use "
                    "interleaved1f1b")
"""``--pp-schedule``'s help, the same on every surface."""


def check_pp_schedule(value: object, option: str = "--pp-schedule") -> str:
    """``value`` if it names a schedule the battery runs; ValueError naming ``option`` otherwise."""
    if isinstance(value, str) and value in REFUSED_PP_SCHEDULES:
        msg = f"{option}={value!r} is not run by the harness: {REFUSED_PP_SCHEDULES[value]}"
        raise ValueError(msg)
    runs = [s for s in PP_SCHEDULES if s not in REFUSED_PP_SCHEDULES]
    if value not in runs:
        msg = f"{option}={value!r} must be one of {', '.join(runs)}"
        raise ValueError(msg)
    return str(value)



PP_STEPS_HELP = ("the schedule steps a pipelined recipe accumulates a window over (A; pipeline.accumulation_steps, "
                 "default 1): the window's microbatches cut into A consecutive parts, one schedule step each, all of "
                 "one shape; a window of fewer microbatches runs its first steps empty")
"""``--pp-steps``' help, the same on every surface."""

PP_MICROBATCHES_HELP = ("the microbatches each schedule step of a pipelined recipe is split into (M; "
                        "pipeline.n_microbatches, default 2)")
"""``--pp-microbatches``' help, the same on every surface."""

PP_MAX_MICROBATCHES = 64
"""The most schedule microbatches a step may be split into: past it a step is mostly wholly ignored padding rows."""


def check_pp_count(value: object, option: str, default: int) -> int:
    """``value`` (a positive number, or its digits as a string, None for ``default``) as an int; ValueError naming
    ``option``, the value and the rule otherwise. ``--pp-steps`` and ``--pp-microbatches`` (``RunSpec.pp_steps`` and
    ``pp_microbatches``) are a training config's accumulation plan, not data: a window of fewer microbatches than A
    steps runs its first steps empty (:meth:`harness.distributed.pipeline.Pipeline.batches`)."""
    if value is None:
        return default
    count = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= PP_MAX_MICROBATCHES:
        example = f"{option} 2" if option.startswith("--") else f"{option}=2"
        msg = (f"{option}={value!r} must be a whole number from 1 to {PP_MAX_MICROBATCHES} (default {default}), e.g. "
               f"{example}")
        raise ValueError(msg)
    return count


DDP_OVER_TP = ("DDP cannot wrap a tensor-parallel (DTensor) model: it raises 'aten.cat.default got mixed "
               "torch.Tensor and DTensor', and its private workaround drops the tp parameters from zero_grad(), so "
               "their gradients pile up; use --strategy fsdp2 (FSDP2 over the data-parallel dimensions, TP over tp, "
               "torchtitan's 2-D layout)")
"""Why a mesh with tp > 1 does not run under DDP (measured with torch 2.13; docs/battery.md)."""


def check_strategy_over(layout: Mesh | None, names: Sequence[str], argument: str = "strategy") -> None:
    """ValueError when a strategy of ``names`` cannot wrap a model over ``layout`` (DDP over tp > 1). Either wraps a
    pipeline's stages over dp (:func:`harness.distributed.pipeline.wrap`)."""
    if layout is not None and layout.size("tp") > 1 and "ddp" in names:
        msg = f"{argument}='ddp' over the mesh {layout.label}: {DDP_OVER_TP}"
        raise ValueError(msg)


def check_format_over(layout: Mesh | None, batch_format: str, argument: str = "batch_format") -> None:
    """ValueError when ``batch_format`` cannot run over ``layout``: packed rows are built for data-parallel ranks (a
    rank's whole sequences), not cut into cp chunks, tp shards or pipeline stages; a pipeline's stages take the
    harness's microbatches (``pipeline.batch`` stacks their token ids and aligned labels), not hf dicts."""
    if layout is not None and batch_format == "hf" and layout.size("pp") > 1:
        msg = (f"{argument}='hf' over the mesh {layout.label}: a pipeline's stages take the harness's microbatches "
               "(pipeline.batch stacks their token ids and aligned labels into a schedule step), not hf dicts; run "
               "pipelines with --batch-format harness")
        raise ValueError(msg)
    if layout is not None and batch_format == "packed" and any(layout.size(d) > 1 for d in ("cp", "tp", "pp")):
        msg = (f"{argument}='packed' over the mesh {layout.label}: packed rows are built for data-parallel ranks "
               "only (a cp chunk, a tp shard or a pipeline stage of a packed row is not built); run this mesh with "
               "--batch-format harness, or packed rows over dp")
        raise ValueError(msg)


__all__ = ["CHUNKING_HELP", "DDP_OVER_TP", "MESH_HELP", "PP_MAX_MICROBATCHES", "PP_MICROBATCHES_HELP",
           "PP_SCHEDULE_HELP", "PP_STEPS_HELP", "check_format_over", "check_layout", "check_pp_count",
           "check_pp_schedule", "check_strategy_over"]


def check_layout(layout: object, world_size: int, argument: str = "layout") -> Mesh:
    """``layout`` if it is a mesh the battery runs over ``world_size`` ranks; ValueError naming it otherwise."""
    if not isinstance(layout, Mesh):
        msg = f"{argument}={layout!r} must be a harness.core.mesh.Mesh, e.g. Mesh.parse('dp=2,cp=2')"
        raise ValueError(msg)
    if layout.world_size != world_size:
        msg = (f"{argument}={layout.label} has {layout.world_size} ranks but world_size={world_size}: the sizes' "
               "product is the world size")
        raise ValueError(msg)
    other = [n for n in layout.names if n not in (*TOKEN_DIMS, "tp", "pp")]
    if other:
        msg = (f"{argument}={layout.label}: the battery runs meshes of pp, data-parallel, cp and tp dimensions "
               f"(pp, {', '.join(TOKEN_DIMS)}, tp); {', '.join(other)} is not run yet")
        raise ValueError(msg)
    beside_ep = [n for n in ("pp", "dp_replicate", "tp") if layout.size(n) > 1]
    if layout.size("ep") > 1 and beside_ep:
        msg = (f"{argument}={layout.label}: expert parallelism (ep > 1) runs beside dp, dp_shard and cp for now; "
               f"{', '.join(beside_ep)} with ep is not run yet (e.g. dp=2,ep=2 or dp_shard=2,ep=2)")
        raise ValueError(msg)
    beside = [n for n in layout.names if n not in ("pp", "dp") and layout.size(n) > 1]
    if layout.size("pp") > 1 and beside:
        msg = (f"{argument}={layout.label}: a pipeline (pp > 1) runs beside dp only for now; {', '.join(beside)} "
               "with pp is not run yet (e.g. pp=2 or dp=2,pp=2)")
        raise ValueError(msg)
    return layout
