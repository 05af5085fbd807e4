"""The record a battery run leaves for judging: what each rank saw after each window (:class:`WindowRecord`), and the
run with its reference chain and what the harness found about the model (:class:`Run`). Every check, reading and
diagnosis takes a :class:`Run`; nothing in it launches anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.battery import scenarios
from harness.battery.plan.options import RunSpec
from harness.battery.prepare.objective import terms, value_at
from harness.battery.prepare.probe.facts import rank_threads
from harness.battery.rank.rng_watch import GeneratorMove
from harness.battery.spec import ModelSpec
from harness.core.formats import HARNESS
from harness.core.mesh import Mesh
from harness.core.microbatch import Microbatch
from harness.core.objectives import PLAIN, Objective
from harness.core.reference import Reference
from harness.diagnosis.evidence import model_at
from harness.distributed.launcher import LaunchError
from harness.distributed.pipeline import ScheduleStep


@dataclass(frozen=True)
class WindowRecord:
    """What one rank saw after one window."""

    grad: torch.Tensor | None
    params_before: torch.Tensor
    params_after: torch.Tensor
    """After the harness's SGD step; after the recipe alone when it refused the window (no step is taken then)."""
    syncs: int
    logged: float | None
    error: str | None
    """``"ValueError: ..."`` when the recipe raised ValueError (the contract's answer to an empty window)."""
    mode_changed: bool
    grad_dtypes: tuple[str, ...]
    rng_changed: tuple[str, ...] = ()
    """The global generators the recipe moved: "python random", "numpy", "torch CPU", "torch CUDA"."""
    rng_moves: tuple[GeneratorMove, ...] = ()
    """Why they moved: the seeding call and its callers down to the recipe's line, or a draw and where it was seen
    (:mod:`harness.battery.rank.rng_watch`)."""
    setup_rng_changed: tuple[str, ...] = ()
    """On the first window's record: the global generators the recipe's ``setup()`` moved (it runs under the same
    watch); ``setup_rng_moves`` says why."""
    setup_rng_moves: tuple[GeneratorMove, ...] = ()
    grads_left: str = "none"
    """The ``.grad`` the recipe left: "none", "zero", "nonzero" or "nonfinite"."""
    weights_touched: float = 0.0
    """Largest change the recipe itself made to a weight during the call (the harness steps only after it)."""
    notes: tuple[str, ...] = ()
    """Global settings the recipe changed that cannot change a gradient (thread count, environment variables)."""
    weights_changed: tuple[str, ...] = ()
    """The parameter tensors the recipe itself changed during the call (bitwise; the harness steps only after it)."""
    autocast: str | None = None
    """``"cpu torch.bfloat16"`` when a forward of the model ran under autocast (device and dtype), else None."""
    grad_norm: float | None = None
    """The total gradient norm a clipping recipe returned (``(loss, norm)``), else None."""
    strategy_notes: tuple[str, ...] = ()
    """What the strategy's own state said after the window (FSDP2's divisor knobs set on some modules only)."""
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...]] | None, ...] = ()
    """Each parameter's local shard on this rank as ``(shape, global offset)`` (None: the rank holds it whole), in
    model order: what a norm over ``grad.to_local()`` covers (:mod:`harness.diagnosis.clipping`)."""
    pipeline_steps: tuple[ScheduleStep, ...] = ()
    """On a mesh with pp: the window's schedule steps in order, each with its microbatch count, ``scale_grads`` and the
    window's rows it held (:class:`harness.distributed.pipeline.ScheduleStep`); read by
    :mod:`harness.diagnosis.pipeline`."""
    logged_dtype: str | None = None
    """The dtype of the logged loss when the recipe returned it as a tensor (``"torch.float32"``), else None: a loss
    computed in float32 and returned so is judged at float32's tolerances in the float64 lane (the logged_loss
    check)."""


@dataclass(frozen=True)
class Run:
    """One recipe on one scenario at one world size and precision."""

    recipe: str
    scenario: str
    world_size: int
    precision: str
    windows: scenarios.Windows
    records: list[list[WindowRecord]] | None = None
    """``records[rank][window]``; None when the run failed (see ``failure``)."""
    references: list[Reference | None] = field(default_factory=list)
    failure: LaunchError | None = None
    init_seed: int | None = None
    """The seed of the model's initial weights (None: the battery config's)."""
    model_path: str | None = None
    """The user's model factory (``--model``); None: the built-in model."""
    batch_format: str = HARNESS
    """``"harness"`` (aligned Microbatch), ``"hf"`` (the dict a Hugging Face loop sees) or ``"packed"`` (its
    padding-free rows); ``--batch-format``."""
    model_error: str | None = None
    """The model's own error when it cannot run a microbatch of this case (found by the reference, before any rank
    started; every check is then n/a with it)."""
    notes: tuple[str, ...] = ()
    """What the harness found about the model for this run (parameters without a gradient, buffers its forward
    changes, find_unused_parameters turned on): properties of the model, never a recipe's mistake."""
    find_unused: bool = False
    """Whether the ranks' DDP ran with ``find_unused_parameters=True``."""
    reference_starts: list[torch.Tensor] = field(default_factory=list)
    """The flat weights each window's reference was taken at: where a rank started from the same weights, the
    reference's own loss is the logged loss's truth."""
    computes_in: str | None = None
    """``"torch.float32"`` when the user's model computes part of its forward below the run's precision (found by
    :func:`harness.battery.prepare.probe.facts.probe_model`): parity then judges at that dtype's tolerances."""
    run_spec: RunSpec | None = None
    """What was run (None for a run assembled by hand, e.g. a test's skewed copy)."""
    max_norm: float | None = None
    """The ``max_norm`` the harness passed a clipping recipe (None: the recipe does not clip)."""
    reference_norms: list[float | None] = field(default_factory=list)
    """Each window's reference gradient norm before clipping (a clipping run only; None: a window without tokens)."""
    bf16: Any = None
    """The bf16 lane's measured noise and derived bound (:class:`harness.battery.prepare.bf16.Noise`); None
    elsewhere."""
    objective: Objective = PLAIN
    """The declared objective as the recipe declares its parts (:func:`harness.battery.prepare.objective.resolve`):
    what the reference, the logged-loss check and the diagnosis compute."""

    def label(self, window: int | None = None) -> str:
        where = f", window {window}" if window is not None else ""
        extra = (f", model {self.model_path}" if self.model_path else "") + (
            f", {self.batch_format} batches" if self.batch_format != HARNESS else "") + (
            f", {self.run_spec.strategy}" if self.run_spec is not None and self.run_spec.strategy != "ddp" else "") + (
            f", mesh {self.run_spec.layout.label}" if self.run_spec is not None and self.run_spec.layout else "")
        return (f"recipe {self.recipe}, world {self.world_size}{where}, {self.precision}, scenario {self.scenario}"
                f"{extra}")

    @property
    def mesh(self) -> Mesh:
        """The layout of the run's ranks (:attr:`harness.battery.plan.options.RunSpec.mesh`); a run assembled by hand is
        data parallel over its world size."""
        return self.run_spec.mesh if self.run_spec is not None else Mesh.data_parallel(self.world_size)

    @property
    def spec(self) -> ModelSpec:
        """The run's model and batch convention."""
        return ModelSpec(self.model_path, self.batch_format, self.init_seed, self.precision)

    def model(self) -> torch.nn.Module:
        """A fresh single-device model with this run's initial weights and precision (the user's factory when
        ``model_path`` is set, else the built-in model), dropout disabled, in train mode."""
        return self.spec.build()

    def loss_sum(self, model: torch.nn.Module, mb: Microbatch) -> torch.Tensor:
        """The loss *sum* of one microbatch under this run's model and batch convention: the quantity the global
        token mean adds up (the reference, the logged-loss check and the diagnosis all go through here)."""
        return self.spec.loss_sum(model, mb)

    def terms(self, model: torch.nn.Module, mb: Microbatch) -> tuple[torch.Tensor, object]:
        """One microbatch's term of the declared objective's numerator and its auxiliary value
        (:func:`harness.battery.prepare.objective.terms`); under the plain token mean, :meth:`loss_sum`."""
        return terms(self.spec, self.objective, model, mb)

    def model_at(self, params: torch.Tensor, dtype: torch.dtype | None = None,
                 probe: Microbatch | None = None) -> torch.nn.Module:
        """A fresh single-device model holding the flat weights ``params`` (model order), in ``dtype`` if given (float64
        with ``probe``: in the model's own dtype where it cannot run in float64, :func:`model_at`)."""
        return model_at(self.spec, params, dtype, probe)

def token_mean_at(run: Run, params: torch.Tensor, window: int) -> float:
    """The global token mean of ``window`` at the weights ``params`` (flat, model order): what a logged loss must be
    when the recipe started the window from those weights, right or wrong. At the weights the reference was taken
    at, it is the reference's own loss (the same forward passes, in the same order)."""
    ref = run.references[window] if window < len(run.references) else None
    if ref is not None and window < len(run.reference_starts) and torch.equal(run.reference_starts[window], params):
        return ref.loss
    model = run.model_at(params)
    if not run.objective.plain:  # the declared objective's value (its auxiliary term included)
        with rank_threads():
            return value_at(run.spec, run.objective, model, run.windows[window])
    with torch.no_grad(), rank_threads():
        total, count = 0.0, 0
        for rank in run.windows[window]:
            for mb in rank:
                total += float(run.loss_sum(model, mb))
                count += mb.supervised
    return total / count

