"""Run a recipe on real ranks over a scenario's windows, and compute the single-device reference beside it.

Rank side (:func:`rank_body`): the model wrapped in DDP with the harness's counting hook, the recipe's optional
``setup()``, its ``backward_window`` per window, then what every check needs: the synchronized gradient, the weights
before and after, the synchronization count, the logged loss, what the recipe left when it refused a window, and
which global random generators or settings it touched. Parent side (:func:`run`): the launch with a deadline, the
reference chain, and a cache so that the checks sharing a run launch it once.

``model`` (``"pkg.mod:factory"``) checks the recipe on a user's model instead of the built-in one, and
``batch_format="hf"`` hands the recipe each microbatch as the dict a Hugging Face loop sees; both travel to the ranks
as one :class:`~harness.battery.spec.ModelSpec`, and the reference is computed with the same model and convention.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from harness.battery import scenarios
from harness.battery.spec import ModelSpec, model_module, weights_digest
from harness.core.compare import PRECISIONS, flat_grad, flat_params
from harness.core.formats import HARNESS, check_batch_format
from harness.core.microbatch import Microbatch
from harness.core.reference import Reference, reference_gradient
from harness.dist import launcher
from harness.dist.launcher import LaunchError, launch
from harness.recipes import recipe_module

LR = 0.1
"""SGD step between windows (plain SGD: the battery checks gradients, not optimizer state)."""

DEADLINE = 30.0
"""Seconds one battery run may take; a recipe that hangs is reported at this deadline, never waited on longer."""

LOCKSTEP_GRACE = 2.0
"""Seconds a rank may lag behind a peer that finished (or refused) the same window before the run is stopped as a
desync: every window ends in a collective (DDP's synchronization, or the count), so ranks finish it together unless
one of them left a collective unmatched."""


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
    grads_left: str = "none"
    """The ``.grad`` the recipe left: "none", "zero", "nonzero" or "nonfinite"."""
    weights_touched: float = 0.0
    """Largest change the recipe itself made to a weight during the call (the harness steps only after it)."""
    notes: tuple[str, ...] = ()
    """Global settings the recipe changed that cannot change a gradient (thread count, environment variables)."""


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
    """``"harness"`` (aligned Microbatch) or ``"hf"`` (the dict a Hugging Face loop sees; ``--batch-format``)."""

    def label(self, window: int | None = None) -> str:
        where = f", window {window}" if window is not None else ""
        extra = (f", model {self.model_path}" if self.model_path else "") + (
            f", {self.batch_format} batches" if self.batch_format != HARNESS else "")
        return (f"recipe {self.recipe}, world {self.world_size}{where}, {self.precision}, scenario {self.scenario}"
                f"{extra}")

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

    def model_at(self, params: torch.Tensor, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """A fresh single-device model holding the flat weights ``params`` (model order), in ``dtype`` if given."""
        model = self.model()
        if dtype is not None:
            model = model.to(dtype)
        with torch.no_grad():
            offset = 0
            for p in model.parameters():
                n = p.numel()
                p.copy_(params[offset : offset + n].view_as(p))
                offset += n
        return model


def _rng_states() -> dict[str, object]:
    states: dict[str, object] = {
        "python random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch CPU": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch CUDA"] = torch.cuda.get_rng_state_all()
    return states


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))  # type: ignore[arg-type]
    return a == b


def _moved(before: dict[str, object], after: dict[str, object]) -> tuple[str, ...]:
    return tuple(name for name in after if name not in before or not _same(before[name], after[name]))


def _settings_notes(threads: int, env: dict[str, str]) -> tuple[str, ...]:
    notes = []
    if torch.get_num_threads() != threads:
        notes.append(f"intra-op threads {threads} -> {torch.get_num_threads()}")
    changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
    if changed:
        notes.append("environment variables changed: " + ", ".join(changed))
    return tuple(notes)


def _grads_left(model: torch.nn.Module) -> str:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return "none"
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        return "nonfinite"
    return "nonzero" if any(bool(g.any()) for g in grads) else "zero"


def rank_body(recipe_path: str, windows: scenarios.Windows, precision: str, device: str, reduction: str = "mean",
              init_seed: int | None = None, spec: ModelSpec | None = None) -> list[WindowRecord]:
    """Runs on every rank: the recipe under DDP with the counting hook, window after window (``spec``: the model and
    batch convention; None: the built-in model with harness batches)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from harness.dist.hooks import attach
    from harness.recipes import load_recipe

    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    recipe = load_recipe(recipe_path)
    spec = spec or ModelSpec(None, HARNESS, init_seed, precision)
    model = spec.build()
    spec.check_weights(model, f"rank {rank}")
    model = model.to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    counter = attach(ddp, reduction)
    ddp.train()
    setup = getattr(recipe, "setup", None)
    if setup is not None:
        setup()
    records = []
    for k, window in enumerate(windows):
        mine = [spec.batch(mb.to(dev)) for mb in window[rank]]
        for p in model.parameters():
            p.grad = None
        before = flat_params(model)
        rngs, threads, env = _rng_states(), torch.get_num_threads(), dict(os.environ)
        counter.syncs = 0
        error = None
        logged = None
        try:
            out = recipe.backward_window(ddp, mine)  # type: ignore[arg-type]
            logged = None if out is None else float(out)
        except ValueError as exc:
            error = f"ValueError: {exc}"
        launcher.progress(k, f"window {k}: refused it ({error})" if error else f"window {k}: done")
        moved, notes = _moved(rngs, _rng_states()), _settings_notes(threads, env)
        grads = tuple(str(p.grad.dtype) for p in model.parameters() if p.grad is not None)
        left = _grads_left(model)
        touched = float((flat_params(model) - before).abs().max()) if before.numel() else 0.0
        grad = flat_grad(model) if error is None else None
        if error is None:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-LR)
        records.append(
            WindowRecord(
                grad=grad, params_before=before, params_after=flat_params(model), syncs=counter.syncs,
                logged=logged, error=error, mode_changed=not (ddp.training and model.training), grad_dtypes=grads,
                rng_changed=moved, grads_left=left, weights_touched=touched, notes=notes,
            )
        )
        if error is not None:
            break  # the window was refused; DDP may hold a half-prepared reduction, so stop here
    del ddp
    return records


def reference_chain(windows: scenarios.Windows, precision: str, init_seed: int | None = None,
                    spec: ModelSpec | None = None) -> list[Reference | None]:
    """The single-device gradient of each window, stepping the same SGD between windows (None: no token at all);
    ``spec`` gives the model and batch convention (None: the built-in model, harness batches)."""
    spec = spec or ModelSpec(None, HARNESS, init_seed, precision)
    model = spec.build()
    refs: list[Reference | None] = []
    for window in windows:
        if sum(mb.supervised for rank in window for mb in rank) == 0:
            refs.append(None)
            continue
        default = spec.path is None and spec.batch_format == HARNESS
        ref = reference_gradient(model, window, None if default else spec.loss_sum)
        refs.append(ref)
        with torch.no_grad():
            offset = 0
            for p in model.parameters():
                n = p.numel()
                p.add_(ref.gradient[offset : offset + n].view_as(p), alpha=-LR)
                offset += n
    return refs


def token_mean_at(run: Run, params: torch.Tensor, window: int) -> float:
    """The global token mean of ``window`` at the weights ``params`` (flat, model order): what a logged loss must be
    when the recipe started the window from those weights, right or wrong."""
    model = run.model_at(params)
    with torch.no_grad():
        total, count = 0.0, 0
        for rank in run.windows[window]:
            for mb in rank:
                total += float(run.loss_sum(model, mb))
                count += mb.supervised
    return total / count


_CACHE: dict[tuple[object, ...], Run] = {}



def run(recipe: str, scenario: str, world_size: int, precision: str = "fp32", *, model: str | None = None,
        batch_format: str = HARNESS, device: str = "cpu", backend: str = "gloo", deadline: float = DEADLINE,
        reduction: str = "mean") -> Run:
    """Launch ``recipe`` on the named ``scenario`` (cached per arguments for the session)."""
    key = (recipe, scenario, world_size, precision, model, batch_format, device, backend, deadline, reduction)
    if key not in _CACHE:
        windows = scenarios.build(scenario, world_size)
        _CACHE[key] = run_windows(recipe, windows, precision, scenario=scenario, model=model,
                                  batch_format=batch_format, device=device, backend=backend, deadline=deadline,
                                  reduction=reduction)
    return _CACHE[key]


def run_windows(recipe: str, windows: scenarios.Windows, precision: str = "fp32", *, scenario: str = "custom",
                model: str | None = None, batch_format: str = HARNESS, device: str = "cpu", backend: str = "gloo",
                deadline: float = DEADLINE, reduction: str = "mean", init_seed: int | None = None,
                env: dict[str, str] | None = None) -> Run:
    """Launch ``recipe`` on explicit ``windows[k][rank][microbatch]`` (world size = ranks per window); not cached.

    ``reduction="sum"`` makes the harness's comm hook sum gradients instead of averaging them (DDP's default);
    ``init_seed`` draws other initial weights (the same on every rank and in the reference). ``model``
    (``"pkg.mod:factory"``) builds the user's model on every rank and for the reference, from the same seed;
    ``batch_format="hf"`` gives the recipe the dicts of :func:`harness.core.formats.to_hf`.
    """
    if precision not in PRECISIONS:
        msg = f"precision={precision!r} must be one of {sorted(PRECISIONS)}"
        raise ValueError(msg)
    if not windows or len({len(w) for w in windows}) != 1:
        msg = "windows must be a non-empty list of windows with the same number of ranks each"
        raise ValueError(msg)
    check_batch_format(batch_format)
    world_size = len(windows[0])
    spec = ModelSpec(model, batch_format, init_seed, precision)
    if model is not None:  # every rank must rebuild the weights the reference starts from
        spec = ModelSpec(model, batch_format, init_seed, precision, digest=weights_digest(spec.build()))
    references = reference_chain(windows, precision, init_seed, spec)
    preload = tuple(m for m in (recipe_module(recipe), model_module(model)) if m)
    args: tuple[object, ...] = (recipe, windows, precision, device, reduction, init_seed)
    if model is not None or batch_format != HARNESS:
        args += (spec,)
    try:
        records = launch(rank_body, world_size, *args, deadline=deadline, backend=backend, device=device, env=env,
                         preload=preload, lockstep_grace=LOCKSTEP_GRACE)
        return Run(recipe, scenario, world_size, precision, windows, records, references, init_seed=init_seed,
                   model_path=model, batch_format=batch_format)
    except LaunchError as exc:
        return Run(recipe, scenario, world_size, precision, windows, None, references, failure=exc,
                   init_seed=init_seed, model_path=model, batch_format=batch_format)


__all__ = ["Run", "WindowRecord", "rank_body", "reference_chain", "run", "run_windows", "token_mean_at"]
