"""Pipeline parallelism over a mesh's ``pp`` dimension: the model split into stages, each pp rank holding one, run by a
``torch.distributed.pipelining`` schedule the recipe builds and steps itself.

- **The split.** The built-in model splits into its units in order: ``tok`` (the token and position embeddings),
  ``blocks.0`` ... ``blocks.{n-1}``, ``ln`` (the final norm), ``head``; :func:`builtin_split` cuts that list at
  split points, unit names where a stage starts (torchtitan's ``pipeline_parallel_split_points``), by default as
  evenly as the units allow. A user's model declares its split beside its factory, ``factory.pp_split``: either a
  list of split points naming top-level children of a model whose forward applies its children in order, or a
  callable ``split(model, n_stages) -> [stage modules]``. Stage modules hold the full model's own submodules under
  their own names, so each parameter keeps its name, and each lies in exactly one stage.
- **Stages per rank.** gpipe and 1f1b run one stage per pp rank (pp stages). The interleaved schedules
  (:data:`harness.core.mesh.MULTI_STAGE_SCHEDULES`) run :data:`STAGES_PER_RANK` = 2 stages per rank, so the model is
  cut into pp*2 stages placed in loops, as torch's interleaved schedules expect: rank r holds stages r and r + pp
  (:func:`local_stages`).
- **The wrap.** :func:`wrap` builds this rank's stages, each wrapped over the data-parallel group when there is one by
  the run's strategy (the harness's DDP, or its FSDP2 sharding of the stage's blocks and the stage over the dp submesh;
  either counts synchronizations), and returns a :class:`PipelineWrapped`: the strategy protocol's object, whose full
  gradient and parameters are gathered over dp where sharded (``full_tensor``), then over the pp group (each
  parameter from the rank whose stage holds it). torch's schedules drive an FSDP2 stage themselves: the gradient
  sync off for every microbatch's backward, one reduce-scatter at the end of each step.
- **The recipe's keyword.** A recipe's ``backward_window`` takes ``pipeline`` (a :class:`Pipeline`): the rank's
  stage, the mesh, :meth:`Pipeline.schedule` (a schedule of ``--pp-schedule`` with the recipe's ``loss_fn`` and
  ``scale_grads``), :meth:`Pipeline.batch` (a window's microbatches as one step's inputs and labels) and
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

SPLIT_ATTRIBUTE = "pp_split"
"""The attribute of a ``--model`` factory that declares its pipeline split: split points (names of top-level children
where a stage starts) or a callable ``split(model, n_stages) -> [stage modules]``."""

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B",
                    "loopedbfs": "ScheduleLoopedBFS", "interleavedzb": "ScheduleInterleavedZeroBubble"}
"""``--pp-schedule``'s names and the ``torch.distributed.pipelining`` classes they build."""

STAGES_PER_RANK = 2
"""How many stages each pp rank holds under a schedule of :data:`harness.core.mesh.MULTI_STAGE_SCHEDULES` (v): two,
the fewest that interleave, so that the built-in one-block model (four units) still runs at pp=2."""

Split = Callable[[nn.Module, int], list[nn.Module]]


class BuiltinStage(nn.Module):
    """A stage of :class:`harness.model.TinyCausalLM`: its embeddings when ``first``, the blocks of ``blocks`` (under
    ``blocks.<i>``, the full model's index), its final norm when the units hold ``ln``, its head when ``last``."""

    def __init__(self, model: nn.Module, units: Sequence[str]) -> None:
        super().__init__()
        self.first, self.norm, self.last = "tok" in units, "ln" in units, "head" in units
        parts: dict[str, nn.Module] = dict(model.named_children())
        blocks: Any = parts["blocks"]
        if self.first:
            self.tok, self.pos, self.drop = parts["tok"], parts["pos"], parts["drop"]
        self.blocks = nn.ModuleDict({u.split(".")[1]: blocks[int(u.split(".")[1])]
                                     for u in units if u.startswith("blocks.")})
        if self.norm:
            self.ln = parts["ln"]
        if self.last:
            self.head = parts["head"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        if self.norm:
            x = self.ln(x)
        return self.head(x) if self.last else x


class SequentialStage(nn.Module):
    """A stage of a model whose forward applies its top-level children in order: the children ``names``, applied in
    order, under their own names."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        for name in names:
            self.add_module(name, getattr(model, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in self.children():
            x = child(x)
        return x


def builtin_units(model: nn.Module) -> list[str]:
    """The built-in model's units in order: ``tok``, ``blocks.0`` ... ``blocks.{n-1}``, ``ln``, ``head`` (the norm
    and the head apart, so that a one-block model still cuts into the four stages of pp=2 interleaved)."""
    return ["tok", *(f"blocks.{i}" for i in range(len(model.blocks))), "ln", "head"]  # type: ignore[arg-type]


def cut(units: Sequence[str], n_stages: int, points: Sequence[str] | None = None,
        argument: str = "pp_split") -> list[list[str]]:
    """``units`` cut into ``n_stages`` consecutive groups at ``points`` (the units where stages 1.. start; None: as
    evenly as the units allow, the earlier stages holding the extra units); ValueError naming ``argument`` otherwise."""
    if n_stages > len(units):
        msg = (f"{argument}: {n_stages} pipeline stages (pp, or pp*{STAGES_PER_RANK} under an interleaved schedule) "
               f"but the model has {len(units)} units to split ({', '.join(units)}): use pp <= {len(units)} with "
               f"gpipe or 1f1b, pp <= {len(units) // STAGES_PER_RANK} with an interleaved schedule, or a model with "
               "more blocks")
        raise ValueError(msg)
    if points is None:
        starts = [len(units) - (len(units) * (n_stages - i)) // n_stages for i in range(1, n_stages)]
    else:
        unknown = [p for p in points if p not in units]
        if unknown or len(points) != n_stages - 1:
            msg = (f"{argument}={list(points)!r} must name {n_stages - 1} of the units {', '.join(units)} where "
                   f"stages 1..{n_stages - 1} start, in order ({n_stages} stages: pp, or pp*{STAGES_PER_RANK} under "
                   "an interleaved schedule)")
            raise ValueError(msg)
        starts = [units.index(p) for p in points]
        if starts != sorted(set(starts)) or starts[0] == 0:
            msg = f"{argument}={list(points)!r} must be increasing units after the first ({units[0]})"
            raise ValueError(msg)
    bounds = [0, *starts, len(units)]
    return [list(units[a:b]) for a, b in itertools.pairwise(bounds)]


def builtin_split(model: nn.Module, n_stages: int, points: Sequence[str] | None = None) -> list[nn.Module]:
    """The built-in model's ``n_stages`` stage modules, cut at ``points`` (:func:`cut`)."""
    return [BuiltinStage(model, group) for group in cut(builtin_units(model), n_stages, points)]


def split_of(model_path: str | None) -> Split:
    """How the run's model splits: the built-in split without ``--model``, else its factory's :data:`SPLIT_ATTRIBUTE`
    (split points or a callable); :class:`harness.model.ModelError` naming what to add when there is none."""
    if model_path is None:
        return builtin_split
    from harness.model import ModelError, load_model_factory

    declared = getattr(load_model_factory(model_path), SPLIT_ATTRIBUTE, None)
    if declared is None:
        msg = (f"model={model_path!r} runs over a mesh with pp > 1 but its factory declares no pipeline split: set "
               f"factory.{SPLIT_ATTRIBUTE} = ['layer3', ...] (the top-level children where stages 1.. start, for a "
               "model whose forward applies its children in order) or a callable split(model, n_stages) returning "
               "the stage modules")
        raise ModelError(msg)
    if callable(declared):
        return declared
    points = [str(p) for p in declared]

    def by_points(model: nn.Module, n_stages: int) -> list[nn.Module]:
        units = [name for name, _ in model.named_children()]
        return [SequentialStage(model, group)
                for group in cut(units, n_stages, points, f"{model_path}.{SPLIT_ATTRIBUTE}")]

    return by_points


def check_split(model: nn.Module, stages: Sequence[nn.Module], argument: str = "pp_split") -> None:
    """ValueError unless every parameter of ``model`` lies in exactly one of ``stages``, under its own name."""
    owners: dict[int, list[int]] = {}
    for i, stage in enumerate(stages):
        for p in stage.parameters():
            owners.setdefault(id(p), []).append(i)
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [n for key, n in names.items() if key not in owners]
    twice = [names.get(key, "?") for key, where in owners.items() if len(where) > 1]
    foreign = [key for key in owners if key not in names]
    if missing or twice or foreign:
        msg = (f"{argument}: every parameter must lie in exactly one stage; missing: {missing[:3]}, in several "
               f"stages: {twice[:3]}, not the model's: {len(foreign)}")
        raise ValueError(msg)


def check_composes(model: nn.Module, stages: Sequence[nn.Module], inputs: torch.Tensor,
                   argument: str = "pp_split") -> None:
    """ValueError unless ``stages`` applied in order to ``inputs`` give ``model``'s own logits: a forward that does
    more than apply its children in order (a function between two of them) loses it in a split by points."""
    from harness.core.formats import logits_of

    with torch.no_grad():
        whole = logits_of(model(inputs))
        x: Any = inputs
        for stage in stages:
            x = stage(x)
        staged = logits_of(x)
    if staged.shape != whole.shape or not torch.allclose(staged, whole, rtol=1e-5, atol=1e-6):
        gap = float((staged - whole).abs().max()) if staged.shape == whole.shape else float("inf")
        msg = (f"{argument}: the stages applied in order do not give the model's own output (they differ by up to "
               f"{gap:.3e}): its forward does more than apply its children in order (a function called between two "
               "of them is lost); declare a callable split(model, n_stages) returning stage modules that compute it")
        raise ValueError(msg)


def stages_per_rank(schedule: str) -> int:
    """How many stages each pp rank holds under ``schedule``: :data:`STAGES_PER_RANK` for the interleaved schedules,
    one otherwise."""
    from harness.core.mesh import MULTI_STAGE_SCHEDULES

    return STAGES_PER_RANK if schedule in MULTI_STAGE_SCHEDULES else 1


def local_stages(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages pp rank ``pp_rank`` holds out of ``pp * per_rank``, in order: ``pp_rank``, ``pp_rank + pp``, ...
    (the looped placement torch's interleaved schedules compute their order for: stage s on rank s % pp)."""
    return [pp_rank + k * pp for k in range(per_rank)]


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
