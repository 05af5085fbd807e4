"""How a model splits into pipeline stages (:mod:`harness.distributed.pipeline` runs them).

- **The built-in model** splits into its units in order: ``tok`` (the token and position embeddings), ``blocks.0``
  ... ``blocks.{n-1}``, ``ln`` (the final norm), ``head``; :func:`builtin_split` cuts that list at split points, unit
  names where a stage starts (torchtitan's ``pipeline_parallel_split_points``), by default as evenly as the units
  allow.
- **A user's model** declares its split beside its factory, ``factory.pp_split``: either a list of split points
  naming top-level children of a model whose forward applies its children in order, or a callable
  ``split(model, n_stages) -> [stage modules]`` (:func:`split_of`). Stage modules hold the full model's own
  submodules under their own names, so each parameter keeps its name, and each lies in exactly one stage
  (:func:`check_split`); applied in order they compute the model's own output (:func:`check_composes`).
- **Stages per rank.** gpipe and 1f1b run one stage per pp rank. The interleaved schedules
  (:data:`harness.core.mesh.MULTI_STAGE_SCHEDULES`) run :data:`STAGES_PER_RANK` = 2 per rank, the model cut into pp*2
  stages placed in loops, as torch's interleaved schedules expect: rank r holds stages r and r + pp
  (:func:`local_stages`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

SPLIT_ATTRIBUTE = "pp_split"
"""The attribute of a ``--model`` factory that declares its pipeline split: split points (names of top-level children
where a stage starts) or a callable ``split(model, n_stages) -> [stage modules]``."""

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


__all__ = ["SPLIT_ATTRIBUTE", "STAGES_PER_RANK", "BuiltinStage", "SequentialStage", "builtin_split", "builtin_units",
           "check_composes", "check_split", "cut", "local_stages", "split_of", "stages_per_rank"]
