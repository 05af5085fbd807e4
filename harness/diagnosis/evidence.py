"""What the diagnosis reads: one plain value, :class:`Evidence`, that any source builds the same way.

The battery builds it from a launch (:func:`harness.diagnosis.diagnose.evidence_of`); a capture of a real
training run builds it from what its hooks saw; a test builds it by hand. It holds, for the windows read:

- per data rank and microbatch, the batch, with its labels and token weights (:attr:`Evidence.windows`);
- per rank, what the rank gave (:class:`RankWindow`): the weights it started the window from and the synchronized
  gradient to read, with the norm a clipping loop returned, its shards and its pipeline steps where there are any;
- per window, the gradient the window should have given at the reference's weights (:attr:`Evidence.references`),
  the weights it was taken at and, where clipping ran, its norm before the clip;
- the model and its loss convention (:class:`Convention`), through which every block gradient is recomputed;
- the mesh, the declared objective (with its auxiliary term), the data-parallel strategy, the precision, the clipping
  bound.

Nothing here launches anything, and no battery type is in it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from harness.core import objectives as ob
from harness.core.mesh import Mesh
from harness.core.microbatch import Microbatch
from harness.core.reference import Reference
from harness.distributed.pipeline import ScheduleStep

Windows = Sequence[Sequence[Sequence[Microbatch]]]
"""``windows[k][data_rank][microbatch]``."""

Auxiliary = Callable[[nn.Module, object, torch.Tensor], object]
"""An auxiliary term of one microbatch: ``auxiliary_loss(model, batch, logits)`` (a tensor; under the ``global``
unit the microbatch's router statistics)."""


class Convention(Protocol):
    """The model and its loss convention: what recomputes a block's gradient on one device.

    :class:`harness.battery.spec.ModelSpec` is one; any object with these members is another."""

    @property
    def path(self) -> str | None:
        """The user's model factory (``"pkg.mod:factory"``); None: the built-in model."""

    @property
    def batch_format(self) -> str:
        """``"harness"``, ``"hf"`` or ``"packed"`` (:mod:`harness.core.formats`)."""

    def build(self) -> nn.Module:
        """A fresh single-device model with the run's initial weights, dropout off, in train mode."""

    def loss_sum(self, model: nn.Module, mb: Microbatch) -> torch.Tensor:
        """The loss sum of one microbatch under the convention."""

    def logits(self, model: nn.Module, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw logits of one microbatch and the logits aligned with its labels."""

    def reference_batch(self, mb: Microbatch) -> object:
        """The batch an auxiliary term is handed for ``mb``."""


@dataclass(frozen=True)
class RankWindow:
    """What one rank gave for one window."""

    grad: torch.Tensor | None
    """The synchronized gradient, flat, in model order (None: the rank left none, or refused the window)."""
    params_before: torch.Tensor
    """The flat weights the rank started the window from."""
    syncs: int = 0
    """Gradient synchronizations the window made (0 where the source cannot count them)."""
    grad_norm: float | None = None
    """The total norm a clipping loop returned."""
    weights_changed: tuple[str, ...] = ()
    """Parameter tensors the loop changed itself before the step (an in-place decay inside the window)."""
    weights_touched: float = 0.0
    """The largest such change."""
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...]] | None, ...] = ()
    """Each parameter's local shard as ``(shape, global offset)`` (None: held whole), in model order."""
    pipeline_steps: tuple[ScheduleStep, ...] = ()
    """On a pipeline: the window's schedule steps (:class:`harness.distributed.pipeline.ScheduleStep`)."""


@dataclass(frozen=True)
class Evidence:
    """Everything the diagnosis reads of one run (see the module's docstring)."""

    windows: Windows
    records: Sequence[Sequence[RankWindow]] | None
    """``records[rank][window]``; None: the run left nothing to read."""
    model: Convention
    mesh: Mesh
    references: Sequence[Reference | None] = ()
    """Each window's expected gradient (clipped where clipping ran) and loss; None: a window without tokens."""
    reference_starts: Sequence[torch.Tensor] = ()
    """The flat weights each reference was taken at."""
    reference_norms: Sequence[float | None] = ()
    """Each window's reference norm before clipping (a clipping run only)."""
    objective: ob.Objective = ob.PLAIN
    auxiliary: Auxiliary | None = None
    """The objective's auxiliary term (None: none declared)."""
    strategy: str = "ddp"
    precision: str = "fp32"
    max_norm: float | None = None
    """The clipping bound (None: the loop does not clip)."""
    chunking: str = "contiguous"
    """How a cp rank's chunk of the positions was cut (:mod:`harness.data.context_parallel`)."""
    stages_per_rank: int = 1
    """On a pipeline: the stages each pp rank holds (the schedule's chunks: 2 under the interleaved ones)."""
    other_scenarios: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """The scenarios run at this mesh, each with its windows' microbatch counts per data rank: where a fact of this
    window equals another, the diagnosis names the one that tells them apart (:mod:`harness.diagnosis.axes`)."""
    computes_in: str | None = None
    """``"torch.float32"`` where the model computes below the run's precision."""
    noise_bound: float | None = None
    """The bf16 lane's derived bound on the gradient's relative error."""
    threads: int | None = None
    """The intra-op thread count the recomputation runs with (the ranks'; None: the caller's)."""
    recipe: str = ""
    """What was run, in words (a recipe's path, a script's name)."""
    scenario: str = ""
    notes: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def batch_format(self) -> str:
        return self.model.batch_format

    @property
    def model_path(self) -> str | None:
        return self.model.path

    def model_at(self, params: torch.Tensor, dtype: torch.dtype | None = None,
                 probe: Microbatch | None = None) -> nn.Module:
        """A fresh single-device model holding the flat weights ``params`` (model order), in ``dtype`` if given (float64
        with ``probe``: in the model's own dtype where it cannot run in float64, :func:`model_at`)."""
        return model_at(self.model, params, dtype, probe)

    def terms(self, model: nn.Module, mb: Microbatch,
              objective: ob.Objective | None = None) -> tuple[torch.Tensor, object]:
        """One microbatch's term of the objective's numerator and its auxiliary value (None without one), from one
        forward of ``model`` (default objective: the declared one)."""
        return terms(self.model, objective or self.objective, self.auxiliary, model, mb)

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Run the body with :attr:`threads` intra-op threads, restoring the caller's after."""
        before = torch.get_num_threads()
        if self.threads is None or before == self.threads:
            yield
            return
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def model_at(convention: Convention, params: torch.Tensor, dtype: torch.dtype | None = None,
             probe: Microbatch | None = None) -> nn.Module:
    """A fresh single-device model of ``convention`` holding the flat weights ``params`` (model order), in ``dtype``
    if given. With ``probe`` (a microbatch of the run) and ``dtype`` float64: a model that cannot run in float64 (its
    forward on ``probe`` raises there, as transformers' ``grouped_mm`` experts do on a CPU torch) is built in its own
    dtype instead, as the pre-flight's backward check is (:mod:`harness.battery.prepare.probe.backward_check`);
    :func:`runs_in_float64` says which, once per model."""
    model = convention.build()
    if dtype is not None and not (dtype == torch.float64 and probe is not None
                                  and not runs_in_float64(convention, probe)):
        model = model.to(dtype)
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            n = p.numel()
            p.copy_(params[offset : offset + n].view_as(p))
            offset += n
    return model


_FLOAT64: dict[tuple[str | None, str], bool] = {}


def first_supervised(windows: Sequence[Sequence[Microbatch]]) -> Microbatch | None:
    """The first microbatch of ``windows`` (per rank) that holds a supervised token (None: none does)."""
    return next((mb for rank in windows for mb in rank if mb.supervised), None)


def runs_in_float64(convention: Convention, probe: Microbatch) -> bool:
    """Whether ``convention``'s model runs its forward on ``probe`` in float64 (tried once per model and batch
    format, then remembered)."""
    key = (convention.path, convention.batch_format)
    if key not in _FLOAT64:
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                convention.loss_sum(convention.build().to(torch.float64), probe)
            _FLOAT64[key] = True
        except Exception:  # whatever the model raises there: it is judged in its own dtype
            _FLOAT64[key] = False
    return _FLOAT64[key]


def terms(convention: Convention, objective: ob.Objective, auxiliary: Auxiliary | None, model: nn.Module,
          mb: Microbatch) -> tuple[torch.Tensor, object]:
    """One microbatch's term of ``objective``'s numerator and its auxiliary value (None without one; under the
    ``global`` unit the microbatch's router statistics, which :func:`harness.core.router_terms.bind` turns into its
    numerator), from one forward of ``model`` under the convention. The plain token mean is the loss sum itself."""
    if objective.plain:
        return convention.loss_sum(model, mb), None
    if objective.auxiliary_unit is None:
        auxiliary = None
    raw, aligned = convention.logits(model, mb)
    term = objective.term(aligned, mb)
    return term, (None if auxiliary is None else auxiliary(model, convention.reference_batch(mb), raw))


__all__ = ["Auxiliary", "Convention", "Evidence", "RankWindow", "Windows", "first_supervised", "model_at",
           "runs_in_float64", "terms"]
