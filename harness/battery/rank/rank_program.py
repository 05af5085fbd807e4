"""The rank program: what every rank of a battery run executes (:func:`rank_body`). The model wrapped by the run's
strategy with the harness's counting hook, the recipe's optional ``setup()`` (given the wrapped model and the mesh by
keyword where it takes them), its ``backward_window`` per window, both under the watch of the global generators,
then what every check needs (:class:`~harness.battery.launch.run.WindowRecord`): the synchronized gradient, the weights
before and after, the synchronization count, the logged loss, what the recipe left when it refused a window, and
which global random generators or settings it touched (:mod:`harness.battery.rank.rank_watch`).
"""

from __future__ import annotations

import contextlib
import os
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from harness.battery import scenarios
from harness.battery.launch.run import WindowRecord
from harness.battery.plan.options import RunSpec
from harness.battery.prepare.chain import LR
from harness.battery.prepare.start import load as load_start
from harness.battery.rank import rank_watch as watch
from harness.battery.rank.rng_watch import GeneratorMove, GeneratorWatch
from harness.battery.rank.window_report import Passes, window_note
from harness.battery.spec import ModelSpec
from harness.data.context_parallel import shard_chunk, supervise_chunk
from harness.distributed import expert_parallel, launcher, pipeline, strategies
from harness.distributed.device_mesh import RankMesh
from harness.distributed.divergence import collective_failure
from harness.distributed.sequence_sharding import plan_of as sequence_plan_of
from harness.distributed.strategies.fsdp2 import local, local_slices, sgd_step
from harness.distributed.tensor_parallel import apply_plan
from harness.recipes import load_recipe
from harness.recipes.contract import (
    COMM_HOOK_OWNED,
    NEEDS_PIPELINE,
    ContractViolation,
    setup_takes_mesh,
    setup_takes_model,
    takes_mesh,
    takes_pipeline,
)


def rank_body(run: RunSpec, windows: scenarios.Windows, digest: str | None = None,
              find_unused: bool = False, max_norm: float | None = None,
              start: torch.Tensor | np.ndarray | None = None) -> list[WindowRecord]:
    """Runs on every rank: ``run``'s recipe on its model wrapped by its strategy (counting synchronizations), window
    after window; ``digest`` is the fingerprint of the initial weights every rank must rebuild (None: the built-in
    model, deterministic), ``find_unused`` whether parameters may miss a gradient in a backward, ``max_norm`` what
    a clipping recipe clips to (:func:`harness.recipes.contract.clips`), ``start`` the flat weights the run starts
    from (:mod:`harness.battery.prepare.start`, computed once by the parent, as a numpy array: a tensor argument would
    travel through a shared-memory file per rank and launch; None: the initial weights)."""
    rank = dist.get_rank()
    cp_rank, cp = run.mesh.coords(rank).get("cp", 0), run.mesh.size("cp")  # the positions this rank is supervised on
    dev = torch.device("cuda", torch.cuda.current_device()) if run.device == "cuda" else torch.device("cpu")
    recipe = load_recipe(run.recipe)
    spec = ModelSpec.of(run, digest)
    model = spec.build()
    spec.check_weights(model, f"rank {rank}")
    load_start(model, start)  # the parent's warmed weights, bitwise: no rank recomputes them with other sums
    model = model.to(dev)
    # The ranks' DeviceMesh: built on every rank of a run over a mesh (the strategy reduces over its token group),
    # and for a recipe that takes it on a dp=W run too.
    mesh = RankMesh(run.mesh, dev.type) if run.layout is not None or takes_mesh(recipe) else None
    if mesh is not None and run.mesh.size("tp") > 1:
        # Tensor parallelism first, then the strategy over the token group (torchtitan's 2-D order): the tp ranks
        # of one dp x cp coordinate train on the same microbatches (their data rank and cp rank are the same).
        apply_plan(model, run.model, mesh.submesh(("tp",)), recipe)
    # A model that shards the sequence itself (its factory's cp_plan) gets only its chunk of each microbatch, with
    # the chunk's positions, and its attention gathers the other cp ranks' keys and values.
    cp_plan = sequence_plan_of(run.model) if cp > 1 else None
    if cp_plan is not None:
        assert mesh is not None
        cp_plan(model, mesh.submesh(("cp",)))
    chunk = supervise_chunk if cp_plan is None else shard_chunk
    # Expert parallelism: each ep rank computes its share of the experts (the model's or the recipe's ep_plan); the
    # strategy then reduces the experts over the expert-data group and the rest over the token group.
    reduction = declared_reduction(recipe, run.reduction)
    experts = None
    if run.mesh.size("ep") > 1:
        assert mesh is not None
        experts = expert_parallel.apply_plan(model, run.model, mesh, recipe, reduction)

    def refuse_comm_hook() -> None:
        raise ContractViolation(COMM_HOOK_OWNED)

    # The bf16 lane: FSDP2 computes in bf16 through its own policy (reducing in float32); DDP has none, so the
    # recipe runs under autocast, as a bf16 DDP training loop does.
    low = run.precision == "bf16"
    pipelined = run.mesh.size("pp") > 1
    wrapped: strategies.Wrapped
    if pipelined:  # this rank's stage, DDP or FSDP2 over dp (harness.distributed.pipeline); the recipe drives it
        if not takes_pipeline(recipe):
            raise ContractViolation(NEEDS_PIPELINE)
        assert mesh is not None
        wrapped = pipeline.wrap(model, run.model, mesh, dev, schedule=run.pp_schedule, strategy=run.strategy,
                                find_unused=find_unused, reduction=reduction,
                                on_comm_hook=refuse_comm_hook,
                                mixed_precision=torch.bfloat16 if low and run.strategy == "fsdp2" else None,
                                accumulation_steps=run.pp_steps, n_microbatches=run.pp_microbatches)
    else:
        wrapped = strategies.get(run.strategy).wrap(model, dev, find_unused=find_unused, reduction=reduction,
                                                    on_comm_hook=refuse_comm_hook,
                                                    mixed_precision=torch.bfloat16 if low else None,
                                                    mesh=None if run.layout is None else
                                                    mesh_of_reduction(mesh, run.strategy), experts=experts)
        if experts is not None:
            wrapped = expert_parallel.ExpertParallelWrapped(wrapped, experts)
    autocast_bf16 = low and run.strategy != "fsdp2"
    ddp = wrapped.module
    autocast = watch.AutocastSeen(dev.type)
    model.register_forward_pre_hook(autocast)
    # What the window's note reports: a rank that skipped its backward is named by it. Under DDP each forward and
    # backward is also reported from inside the window, with the synchronizations begun: a rank that dies in the
    # window (gloo's size check, NCCL's watchdog) is named from these.
    passes = Passes(lambda k, note, begun: launcher.progress(k, note, collectives=begun, finished=False))
    passes.attach(model)
    if isinstance(ddp, DistributedDataParallel):
        passes.count_syncs(partial(_prepares_sync, ddp), "DDP all-reduce")
    ddp.train()
    # The recipe's keywords: what a clipping recipe clips to, and the ranks' DeviceMesh for one that takes it.
    keywords: dict[str, object] = {}
    if max_norm is not None:
        keywords["max_norm"] = max_norm
    if mesh is not None and takes_mesh(recipe):
        keywords["mesh"] = mesh.device_mesh
    if isinstance(wrapped, pipeline.PipelineWrapped):
        keywords["pipeline"] = wrapped.pipeline
    # setup() runs under the same watch of the global generators as each window: what it moves (a Trainer built
    # there seeds them) is reported against setup on the first window's record.
    generators = GeneratorWatch(model)
    setup_moved: tuple[str, ...] = ()
    setup_moves: tuple[GeneratorMove, ...] = ()
    setup = getattr(recipe, "setup", None)
    if setup is not None:
        given: dict[str, object] = {}
        if mesh is not None and setup_takes_mesh(recipe):
            given["mesh"] = mesh.device_mesh
        if setup_takes_model(recipe):
            given["model"] = ddp  # the wrapped model backward_window receives: what a Trainer is built around
        with generators:
            setup(**given)
        setup_moved, setup_moves = generators.moved, generators.moves
    records = []
    after = None  # the weights the last window stepped to: the next window starts from them
    shards = local_slices(model) if max_norm is not None else ()  # what a norm over local shards covers
    for k, window in enumerate(windows):
        mine = [spec.batch(chunk(mb, cp_rank, cp, run.chunking).to(dev))
                for mb in window[run.mesh.data_rank(rank)]]
        for p in model.parameters():
            p.grad = None
        # Nothing between two windows moves a weight: the last window's gathered weights after its step are this
        # one's before (a copy, so that no record shares a tensor with another), without gathering them again.
        before = wrapped.full_params() if after is None else after.clone()
        tensors = [local(p.detach()).clone() for p in model.parameters()]
        autocast.seen = None
        passes.reset(k, len(mine))
        threads, env = torch.get_num_threads(), dict(os.environ)
        wrapped.reset_syncs()
        error = None
        logged = None
        logged_dtype = None
        norm = None
        if isinstance(wrapped, pipeline.PipelineWrapped):
            wrapped.pipeline.watch(mine)  # the window's schedule steps, recorded by pipeline.step
        try:
            try:
                with generators, \
                        torch.autocast(dev.type, dtype=torch.bfloat16) if autocast_bf16 else contextlib.nullcontext():
                    out = recipe.backward_window(ddp, mine, **keywords)  # type: ignore[arg-type]
                    if isinstance(out, tuple) and len(out) == 2:
                        out, norm = out[0], None if out[1] is None else watch.as_float(out[1])
                logged = None if out is None else float(out)
                logged_dtype = str(out.dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else None
            except ValueError as exc:
                error = f"ValueError: {exc}"
            except AttributeError as exc:
                mismatch = strategy_mismatch(str(exc), run.strategy)
                if mismatch is None:
                    raise
                raise ContractViolation(mismatch) from exc
        except BaseException as exc:
            # A collective's failure (a peer's abort, a timeout) keeps what this rank reported from inside the
            # window; an exception of the recipe's own is the cause, and counts nothing that could blame a peer.
            if not collective_failure(exc):
                launcher.progress(k, f"raised {type(exc).__name__} in window {k}", finished=False)
            raise
        left = watch.grads_left(model)
        launcher.progress(k, window_note(k, wrapped.syncs, passes, left, error), collectives=wrapped.syncs)
        notes = watch.settings_notes(threads, env)
        grads = tuple(str(p.grad.dtype) for p in model.parameters() if p.grad is not None)
        touched = float((wrapped.full_params() - before).abs().max()) if before.numel() else 0.0
        edited = watch.changed_tensors(tensors, model)
        grad = wrapped.full_grad() if error is None else None
        if error is None:
            sgd_step(model, LR)
        after = wrapped.full_params()
        records.append(
            WindowRecord(
                grad=grad, params_before=before, params_after=after, syncs=wrapped.syncs,
                logged=logged, error=error, mode_changed=not (ddp.training and model.training), grad_dtypes=grads,
                rng_changed=generators.moved, rng_moves=generators.moves, grads_left=left, weights_touched=touched,
                notes=notes, weights_changed=edited,
                autocast=autocast.seen, grad_norm=norm, strategy_notes=wrapped.notes(), shards=shards,
                pipeline_steps=tuple(wrapped.pipeline.steps) if isinstance(wrapped, pipeline.PipelineWrapped) else (),
                logged_dtype=logged_dtype,
                setup_rng_changed=setup_moved if k == 0 else (), setup_rng_moves=setup_moves if k == 0 else (),
            )
        )
        if error is not None:
            break  # the window was refused; DDP may hold a half-prepared reduction, so stop here
    passes.armed = None
    del ddp, wrapped  # before the process group goes away (a DDP module alive then can keep the rank from exiting)
    return records


def _prepares_sync(ddp: DistributedDataParallel) -> bool:
    """Whether a forward of ``ddp`` run now prepares the all-reduce of its backward (outside ``no_sync()``)."""
    return bool(ddp.require_backward_grad_sync) and torch.is_grad_enabled()


def mesh_of_reduction(mesh: RankMesh | None, strategy: str = "ddp") -> object:
    """The ``DeviceMesh`` ``strategy`` reduces gradients over: the token group's dimensions (dp x cp; tp and pp ranks
    hold the same tokens and are not in it) flattened into one, or under FSDP2 on a mesh with ``dp_replicate`` and a
    dimension to shard over, HSDP's 2-D mesh (``dp_replicate`` x ``dp_shard_cp``, as torchtitan builds it). DDP has one
    group: over an HSDP mesh it all-reduces over every token dimension flattened, which averages the same gradient."""
    assert mesh is not None
    token = mesh.mesh.token_dims
    if strategy == "fsdp2" and "dp_replicate" in token and len(token) > 1:
        return mesh.replicate_shard()
    return mesh.submesh(token)


def declared_reduction(recipe: object, chosen: str | None = None) -> str:
    """How the ranks must combine gradients for ``recipe``: ``chosen`` when the run names one (a test that runs a
    recipe under the other reduction on purpose), else its ``reduction`` attribute when it declares one (``"sum"``:
    written for a summing reduction, as torchtitan's loss is: divided by the global count without a world-size
    factor), else the average (data parallelism's default)."""
    if chosen is not None:
        return chosen
    declared = getattr(recipe, "reduction", None)
    if declared is None:
        return "mean"
    if declared not in ("mean", "sum"):
        msg = (f"{type(recipe).__name__}.reduction={declared!r} must be 'mean' (the ranks' gradients are averaged, "
               "the default) or 'sum' (they are summed: a loss divided by the global count without a world-size "
               "factor)")
        raise ValueError(msg)
    return str(declared)


SKIP_SYNC = {"ddp": "model.no_sync()", "fsdp2": "model.set_requires_gradient_sync(False)"}
"""How a recipe skips a gradient synchronization under each strategy."""


def strategy_mismatch(error: str, strategy: str) -> str | None:
    """The usage error for a recipe that skipped a synchronization the way of another strategy than the run's
    (``AttributeError`` text ``error``), else None."""
    wrong = next((s for s, call in SKIP_SYNC.items() if s != strategy and call.split("(")[0][6:] in error), None)
    if wrong is None or strategy not in SKIP_SYNC:
        return None
    return (f"the recipe called {SKIP_SYNC[wrong]}, {wrong.upper()}'s way to skip a gradient synchronization, on a "
            f"model under {strategy} ({error.strip()}): under {strategy} use {SKIP_SYNC[strategy]} around all "
            "but the last microbatch, or harness.recipes.helpers.sync_context(model, i, n), which does the right "
            "thing under either strategy")
