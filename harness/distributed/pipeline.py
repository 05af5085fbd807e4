"""Pipeline parallelism over a mesh's ``pp`` dimension: the model split into stages
(:mod:`harness.distributed.pipeline_split`, whose names this module re-exports), each pp rank holding one (two under
an interleaved schedule), run by a ``torch.distributed.pipelining`` schedule the recipe builds and steps itself.

- **The wrap.** :func:`wrap` builds this rank's stages, each wrapped over the data-parallel group when there is one by
  the run's strategy (the harness's DDP, or its FSDP2 sharding of the stage's blocks and the stage over the dp submesh;
  either counts synchronizations), and returns a :class:`PipelineWrapped`: the strategy protocol's object, whose full
  gradient and parameters are gathered over dp where sharded (``full_tensor``), then over the pp group (each
  parameter from the rank whose stage holds it). torch's schedules drive an FSDP2 stage themselves: the gradient
  sync off for every microbatch's backward, one reduce-scatter at the end of each step.
- **The recipe's keyword.** A recipe's ``backward_window`` takes ``pipeline`` (a :class:`Pipeline`): the rank's
  stages, the mesh, :meth:`Pipeline.schedule` (a schedule of ``--pp-schedule`` with the recipe's ``loss_fn`` and
  ``scale_grads``), :meth:`Pipeline.batches` (a window as A steps' inputs and labels of one shape) and
  :meth:`Pipeline.step`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from harness.core.mesh import Mesh
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.distributed.pipeline_split import (
    SPLIT_ATTRIBUTE,
    STAGES_PER_RANK,
    BuiltinStage,
    SequentialStage,
    builtin_split,
    builtin_units,
    check_composes,
    check_split,
    cut,
    local_stages,
    split_of,
    stages_per_rank,
)

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B",
                    "loopedbfs": "ScheduleLoopedBFS", "interleavedzb": "ScheduleInterleavedZeroBubble"}
"""``--pp-schedule``'s names and the ``torch.distributed.pipelining`` classes they build."""


def _pp_group_of(rank_mesh: Any) -> Any:
    return rank_mesh.submesh(("pp",)).get_group()


def parts(window: Sequence[Any], steps: int) -> list[list[Any]]:
    """``window``'s microbatches in ``steps`` consecutive parts, as even as they allow (the later parts one longer
    where they do not divide evenly: 3 in 2 steps are 1 and 2; 1 in 2 steps is none, then 1)."""
    if steps < 1:
        msg = f"steps={steps!r}: a window runs as at least one schedule step"
        raise ValueError(msg)
    cuts = [len(window) * i // steps for i in range(steps + 1)]
    return [list(window[a:b]) for a, b in itertools.pairwise(cuts)]


class ScheduleStep(NamedTuple):
    """One ``schedule.step`` of a window as :meth:`Pipeline.step` recorded it: the schedule's microbatch count and
    ``scale_grads``, and the window's rows the step's batch held, as ``(microbatch, row)`` in the step's order (a
    row matched by its inputs and labels; wholly ignored padding rows are not listed). ``foreign``: the step's rows
    with a supervised token that match no row of the window."""

    n_microbatches: int
    scale_grads: bool
    rows: tuple[tuple[int, int], ...]
    foreign: int = 0
    batch_rows: int = 0
    """The rows of the step's batch, padding included (0: not recorded): the schedule splits them into
    ``n_microbatches`` chunks along dim 0 (:func:`chunk_of`)."""
    at: tuple[int, ...] = ()
    """Each of ``rows``' position in the step's batch (empty: not recorded)."""


def chunk_of(position: int, batch_rows: int, n_microbatches: int) -> int:
    """The schedule microbatch that holds row ``position`` of a step's batch of ``batch_rows`` rows: torch's
    pipelining splits the batch with ``torch.tensor_split`` along dim 0, the first ``batch_rows % n_microbatches``
    chunks one row longer."""
    if not 0 <= position < batch_rows or n_microbatches < 1:
        msg = (f"position={position} must lie in a batch of batch_rows={batch_rows} rows split into "
               f"n_microbatches={n_microbatches} >= 1 chunks")
        raise ValueError(msg)
    size, extra = divmod(batch_rows, n_microbatches)
    long_rows = extra * (size + 1)
    return position // (size + 1) if position < long_rows else extra + (position - long_rows) // max(size, 1)


def rows_of(window: Sequence[Any], inputs: torch.Tensor, labels: torch.Tensor,
            at: list[int] | None = None) -> tuple[list[tuple[int, int]], int]:
    """Which of ``window``'s rows a step's ``(inputs, labels)`` hold (each window row once, the first unused match),
    and how many of its supervised rows match none; ``at``, when given, receives each found row's position."""
    candidates = [(i, j, mb.inputs[j], mb.labels[j]) for i, mb in enumerate(window) if hasattr(mb, "inputs")
                  for j in range(mb.inputs.shape[0])]
    used: set[tuple[int, int]] = set()
    rows, foreign = [], 0
    for r in range(labels.shape[0]):
        found = next(((i, j) for i, j, x, y in candidates if (i, j) not in used and x.shape[0] <= labels.shape[1]
                      and torch.equal(inputs[r, :x.shape[0]], x) and torch.equal(labels[r, :y.shape[0]], y)
                      and bool((labels[r, y.shape[0]:] == IGNORE_INDEX).all())), None)
        if found is not None:
            used.add(found)
            rows.append(found)
            if at is not None:
                at.append(r)
        elif bool((labels[r] != IGNORE_INDEX).any()):
            foreign += 1
    return rows, foreign


class Pipeline:
    """What a recipe drives a pipelined window with (its ``pipeline`` keyword): this rank's ``stages`` (its
    ``PipelineStage`` objects in stage order; ``stage`` is the first), ``mesh`` (the ranks' ``DeviceMesh``), the
    schedule's name, and the groups a count is reduced over (:attr:`token_group`, None when the mesh has no
    data-parallel dimension: the count is then this rank's own). ``is_first``: this rank holds stage 0 and passes the
    inputs; ``is_last``: it holds the last stage, computes the losses and passes the target.

    The run's accumulation plan, as a training config gives it to the loop (``--pp-steps``, ``--pp-microbatches``):
    :attr:`accumulation_steps` (A) schedule steps per window, :attr:`n_microbatches` (M) microbatches per step. The
    correct recipe drives its windows by it; a recipe may choose its own."""

    def __init__(self, stages: Sequence[Any], device_mesh: Any, mesh: Mesh, schedule_name: str, token_group: Any, *,
                 accumulation_steps: int = 1, n_microbatches: int = 2) -> None:
        self.stages = list(stages)
        self.stage = self.stages[0]
        self.mesh = device_mesh
        self.layout = mesh
        self.schedule_name = schedule_name
        self.token_group = token_group
        self.token_group_size = 1 if token_group is None else dist.get_world_size(token_group)
        self.pp_group = device_mesh["pp"].get_group()
        self.is_first = any(stage.is_first for stage in self.stages)
        self.is_last = any(stage.is_last for stage in self.stages)
        self.window: Sequence[Any] = ()
        self.steps: list[ScheduleStep] = []
        """The window's schedule steps so far (:meth:`watch` starts a window)."""
        self.accumulation_steps = accumulation_steps
        """A: the schedule steps of each window in the run's plan (``--pp-steps``; :attr:`steps` is what ran)."""
        self.n_microbatches = n_microbatches
        """M: the microbatches of each schedule step in the run's plan (``--pp-microbatches``)."""

    def watch(self, window: Sequence[Any]) -> None:
        """Start recording the schedule steps of ``window`` (the harness calls it before each window)."""
        self.window, self.steps = window, []

    def schedule(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n_microbatches: int, *,
                 scale_grads: bool = True) -> Any:
        """A new schedule of ``--pp-schedule`` over this rank's stages: ``n_microbatches`` per step, ``loss_fn(output,
        target)`` on each microbatch of the last stage, ``scale_grads`` as torch's (its default, True, divides the
        gradients by ``n_microbatches`` at the end of every step). A schedule of several stages per rank takes the list
        of them, the others the one stage."""
        from torch.distributed import pipelining
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        cls = getattr(pipelining, SCHEDULE_CLASSES[self.schedule_name])
        multi = issubclass(cls, PipelineScheduleMulti)
        if multi != (len(self.stages) > 1):  # wrap() builds as many stages as stages_per_rank(schedule) says
            msg = (f"--pp-schedule={self.schedule_name!r} ({cls.__name__}) over {len(self.stages)} stage(s) per rank: "
                   "build the pipeline with wrap(), which places stages_per_rank(schedule) stages on each rank")
            raise ValueError(msg)
        stages = self.stages if multi else self.stage
        return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)

    @staticmethod
    def batch(window: Sequence[Microbatch], n_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``window``'s microbatches as one schedule step's ``(inputs, labels)``: their rows stacked, padded on the
        right to the longest (``PAD`` inputs, ignored labels: causal attention keeps the padding out of every real
        position), and padded with wholly ignored rows to a multiple of ``n_microbatches`` (a schedule splits a step
        into equal microbatches). The same tokens are supervised, so a loss sum over it is the window's."""
        if not window:
            msg = "a pipelined window needs at least one microbatch"
            raise ValueError(msg)
        longest = max(mb.inputs.shape[1] for mb in window)
        rows = sum(mb.inputs.shape[0] for mb in window)
        total = -(-rows // n_microbatches) * n_microbatches
        ref = window[0].inputs
        inputs = torch.full((total, longest), PAD, dtype=ref.dtype, device=ref.device)
        labels = torch.full((total, longest), IGNORE_INDEX, dtype=ref.dtype, device=ref.device)
        at = 0
        for mb in window:
            b, t = mb.inputs.shape
            inputs[at:at + b, :t] = mb.inputs
            labels[at:at + b, :t] = mb.labels
            at += b
        return inputs, labels

    @staticmethod
    def batches(window: Sequence[Microbatch], steps: int,
                n_microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``window`` as ``steps`` schedule steps' ``(inputs, labels)``, every one of the same shape, so that one
        schedule drives them all (a schedule infers the stage's shapes on its first step only, and a new schedule
        per step re-initialises the stage: on FSDP2 stages that clears the gradients accumulated so far). The
        microbatches are cut into ``steps`` consecutive parts (:func:`parts`), each stacked by :meth:`batch`, then
        padded to the most rows and the longest row of any part; a part without microbatches (more steps than
        microbatches) is a step of wholly ignored rows, which still runs on every stage."""
        if not window:
            msg = "a pipelined window needs at least one microbatch"
            raise ValueError(msg)
        stacked = [Pipeline.batch(part, n_microbatches) if part else None for part in parts(window, steps)]
        rows = max(b[0].shape[0] for b in stacked if b is not None)
        length = max(b[0].shape[1] for b in stacked if b is not None)
        ref = window[0].inputs
        out = []
        for b in stacked:
            inputs = torch.full((rows, length), PAD, dtype=ref.dtype, device=ref.device)
            labels = torch.full((rows, length), IGNORE_INDEX, dtype=ref.dtype, device=ref.device)
            if b is not None:
                inputs[:b[0].shape[0], :b[0].shape[1]], labels[:b[1].shape[0], :b[1].shape[1]] = b
            out.append((inputs, labels))
        return out

    def step(self, schedule: Any, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """One ``schedule.step``: the first stage passes ``inputs``, the last ``labels`` as the target; returns the
        last stage's per-microbatch losses (empty on the others). The step is recorded on :attr:`steps`."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        # A new schedule's first step infers the shapes with a forward and backward of its own; under DDP that
        # backward would all-reduce placeholder gradients (a synchronization more per step). Inside no_sync() the
        # inference's forward prepares no reduction, and the schedule's last backward prepares DDP's one itself.
        # Every local stage's DDP is quieted alike: the interleaved schedules infer each one's shapes.
        with contextlib.ExitStack() as quiet:
            for stage in self.stages:
                if isinstance(stage.submod, DistributedDataParallel):
                    quiet.enter_context(stage.submod.no_sync())
            if self.is_last:
                schedule.step(*args, target=labels, losses=losses)
            else:
                schedule.step(*args)
        at: list[int] = []
        rows, foreign = rows_of(self.window, inputs, labels, at)
        self.steps.append(ScheduleStep(int(getattr(schedule, "_n_microbatches", 0)),
                                       bool(getattr(schedule, "scale_grads", True)), tuple(rows), foreign,
                                       int(labels.shape[0]), tuple(at)))
        return losses

    def from_last(self, value: float) -> float:
        """``value`` as the last stage of this rank's pipeline holds it, on every stage (a broadcast over pp)."""
        t = torch.tensor(float(value), dtype=torch.float64)
        ranks = dist.get_process_group_ranks(self.pp_group)
        dist.broadcast(t, src=ranks[-1], group=self.pp_group)
        return float(t)


class PipelineWrapped:
    """One rank's stages under the strategy protocol (:class:`harness.distributed.strategies.base.Wrapped`):
    ``module`` is the stage (DDP or FSDP2 over the data-parallel group when there is one; with several stages per
    rank, an ``nn.ModuleList`` of them), ``local`` the full model; the full gradient and parameters are gathered over
    dp where sharded, then over the pp group, each parameter from the rank whose stage holds it. ``inners``: each
    stage's strategy wrap, in stage order (empty without dp)."""

    def __init__(self, model: nn.Module, stage_modules: Sequence[nn.Module], inners: Sequence[Any],
                 pipeline: Pipeline) -> None:
        self.local: nn.Module = model
        self.stage_modules = list(stage_modules)
        self.stage_module = self.stage_modules[0]
        self._inners = list(inners)
        wrapped = [inner.module for inner in self._inners] if self._inners else self.stage_modules
        self.module: nn.Module = wrapped[0] if len(wrapped) == 1 else nn.ModuleList(wrapped)
        self.pipeline = pipeline
        self.no_sync: str = "model.no_sync()" if not self._inners else self._inners[0].no_sync
        held = {id(p) for m in self.stage_modules for p in m.parameters()}
        self._held = [id(p) in held for p in model.parameters()]

    @property
    def syncs(self) -> int:
        """The window's synchronizations as one_sync reads them: each stage module over dp synchronizes on its own
        (its DDP all-reduce, its FSDP2 reduce-scatter), so with several stages per rank a window counts one when each
        of them synchronized once; otherwise the stage count farthest from one (a stage that synchronized twice gives
        2, one that never did 0), so that no stage's miss or excess hides behind another's one."""
        if not self._inners:
            return 0
        counts = [int(inner.syncs) for inner in self._inners]
        return max(counts, key=lambda c: abs(c - 1))

    def reset_syncs(self) -> None:
        for inner in self._inners:
            inner.reset_syncs()

    def notes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(note for inner in self._inners for note in inner.notes()))

    def _gathered(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        # A sharded (FSDP2) tensor is gathered over dp first (full_tensor: a collective the dp ranks of one stage call
        # alike, in model order), then each parameter comes from its one holder over pp, zeros elsewhere.
        parts = []
        for p, t, held in zip(self.local.parameters(), tensors, self._held, strict=True):
            if not held or t is None:
                parts.append(torch.zeros(p.numel(), dtype=p.dtype))
                continue
            full = getattr(t, "full_tensor", None)
            parts.append((full() if full is not None else t).detach().reshape(-1).cpu())
        out = torch.cat(parts)
        dist.all_reduce(out, group=self.pipeline.pp_group)
        return out

    def full_grad(self) -> torch.Tensor:
        return self._gathered([p.grad for p in self.local.parameters()])

    def full_params(self) -> torch.Tensor:
        return self._gathered(list(self.local.parameters()))


def wrap(model: nn.Module, model_path: str | None, rank_mesh: Any, device: torch.device, *, schedule: str,
         strategy: str = "ddp", reduction: str = "mean", find_unused: bool = False,
         on_comm_hook: Callable[[], None] | None = None,
         mixed_precision: torch.dtype | None = None, accumulation_steps: int = 1,
         n_microbatches: int = 2) -> PipelineWrapped:
    """This rank's stages of ``model`` over ``rank_mesh`` (a :class:`harness.distributed.device_mesh.RankMesh` with a
    ``pp`` dimension and at most ``dp`` besides): the model cut into ``pp * stages_per_rank(schedule)`` stages, this
    rank holding :func:`local_stages`, each wrapped by ``strategy`` over dp when dp > 1 (DDP, or FSDP2: each block and
    the stage sharded over dp, ``mixed_precision`` its policy), each in a ``PipelineStage`` over the pp group; the
    :class:`Pipeline` carries the run's plan (``accumulation_steps``, ``n_microbatches``)."""
    from torch.distributed.pipelining import PipelineStage

    from harness.distributed import strategies

    mesh: Mesh = rank_mesh.mesh
    pp, me = mesh.size("pp"), mesh.coords(dist.get_rank())["pp"]
    n_stages = pp * stages_per_rank(schedule)
    stages = split_of(model_path)(model, n_stages)
    if len(stages) != n_stages:
        msg = (f"the pipeline split of model={model_path!r} returned {len(stages)} stages for pp={pp} under "
               f"--pp-schedule={schedule!r}: it must return pp*{stages_per_rank(schedule)} = {n_stages}")
        raise ValueError(msg)
    check_split(model, stages, f"{model_path or 'the built-in model'}'s pipeline split")
    mine = local_stages(me, pp, stages_per_rank(schedule))
    stage_modules = [stages[i] for i in mine]
    inners: list[Any] = []
    token_group = None
    if mesh.token_dims:
        dp_mesh = rank_mesh.submesh(mesh.token_dims)
        # One wrap per stage module: each is its own DDP (its own reducer and comm hook) or its own FSDP2 root.
        inners = [strategies.get(strategy).wrap(m, device, find_unused=find_unused, reduction=reduction,
                                                on_comm_hook=on_comm_hook, mesh=dp_mesh,
                                                mixed_precision=mixed_precision) for m in stage_modules]
        token_group = dp_mesh.get_group()
    group = _pp_group_of(rank_mesh)
    pp_stages = [PipelineStage(m if not inners else inners[k].module, i, n_stages, device, group=group)
                 for k, (i, m) in enumerate(zip(mine, stage_modules, strict=True))]
    pipeline = Pipeline(pp_stages, rank_mesh.device_mesh, mesh, schedule, token_group,
                        accumulation_steps=accumulation_steps, n_microbatches=n_microbatches)
    return PipelineWrapped(model, stage_modules, inners, pipeline)


__all__ = [
    "SCHEDULE_CLASSES",
    "SPLIT_ATTRIBUTE",
    "STAGES_PER_RANK",
    "BuiltinStage",
    "Pipeline",
    "PipelineWrapped",
    "ScheduleStep",
    "SequentialStage",
    "builtin_split",
    "builtin_units",
    "check_composes",
    "check_split",
    "chunk_of",
    "cut",
    "local_stages",
    "parts",
    "rows_of",
    "split_of",
    "stages_per_rank",
    "wrap",
]
