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

import contextlib
import os
import random
import re
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from harness.battery import scenarios
from harness.battery.gradless import unused_notes
from harness.battery.options import DEADLINE, FIND_UNUSED, RunSpec, check_find_unused
from harness.battery.spec import ModelSpec, model_modules, weights_digest
from harness.battery.start import load as load_start
from harness.battery.start import start_note, start_weights
from harness.battery.window_report import Passes, window_note
from harness.core.compare import flat_params
from harness.core.formats import HARNESS
from harness.core.microbatch import Microbatch
from harness.core.objectives import PLAIN, Objective
from harness.core.reference import Reference, reference_gradient
from harness.distributed import launcher
from harness.distributed.launcher import LaunchError, launch
from harness.distributed.strategies.fsdp2 import local
from harness.recipes import recipe_module

LR = 0.1
"""SGD step between windows (plain SGD: the battery checks gradients, not optimizer state)."""

CLIP_FRACTION = 0.5
"""A clipping recipe clips to this fraction of the first window's reference gradient norm: below every norm it is
judged at would check nothing of the clipping."""

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
    weights_changed: tuple[str, ...] = ()
    """The parameter tensors the recipe itself changed during the call (bitwise; the harness steps only after it)."""
    autocast: str | None = None
    """``"cpu torch.bfloat16"`` when a forward of the model ran under autocast (device and dtype), else None."""
    grad_norm: float | None = None
    """The total gradient norm a clipping recipe returned (``(loss, norm)``), else None."""
    strategy_notes: tuple[str, ...] = ()
    """What the strategy's own state said after the window (FSDP2's divisor knobs set on some modules only)."""


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
    :func:`harness.battery.facts.probe_model`): parity then judges at that dtype's tolerances."""
    run_spec: RunSpec | None = None
    """What was run (None for a run assembled by hand, e.g. a test's skewed copy)."""
    max_norm: float | None = None
    """The ``max_norm`` the harness passed a clipping recipe (None: the recipe does not clip)."""
    reference_norms: list[float | None] = field(default_factory=list)
    """Each window's reference gradient norm before clipping (a clipping run only; None: a window without tokens)."""
    bf16: Any = None
    """The bf16 lane's measured noise and derived bound (:class:`harness.battery.bf16.Noise`); None elsewhere."""
    objective: Objective = PLAIN
    """The declared objective as the recipe declares its parts (:func:`harness.battery.objective.resolve`): what the
    reference, the logged-loss check and the diagnosis compute."""

    def label(self, window: int | None = None) -> str:
        where = f", window {window}" if window is not None else ""
        extra = (f", model {self.model_path}" if self.model_path else "") + (
            f", {self.batch_format} batches" if self.batch_format != HARNESS else "") + (
            f", {self.run_spec.strategy}" if self.run_spec is not None and self.run_spec.strategy != "ddp" else "")
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

    def terms(self, model: torch.nn.Module, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One microbatch's term of the declared objective's numerator and its auxiliary value
        (:func:`harness.battery.objective.terms`); under the plain token mean, :meth:`loss_sum`."""
        from harness.battery.objective import terms

        return terms(self.spec, self.objective, model, mb)

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


def _as_float(value: object) -> float:
    """A returned norm as a float: a tensor, or FSDP2's replicated DTensor (its local value is the whole norm)."""
    local = getattr(value, "to_local", None)
    return float(local() if local is not None else value)  # type: ignore[arg-type]


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
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    if not grads:
        return "none"
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        return "nonfinite"
    return "nonzero" if any(bool(g.any()) for g in grads) else "zero"


def _changed(before: list[torch.Tensor], model: torch.nn.Module) -> tuple[str, ...]:
    return tuple(n for (n, p), b in zip(model.named_parameters(), before) if not torch.equal(local(p.detach()), b))


class _AutocastSeen:
    """A forward pre-hook that records whether the model's forward runs under autocast, and in which dtype."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.seen: str | None = None

    def __call__(self, module: torch.nn.Module, args: object) -> None:
        if self.seen is None and _autocast_enabled(self.device_type):
            where = _caller()
            self.seen = (f"{self.device_type} {_autocast_dtype(self.device_type)}"
                         f"{f', entered around the model call at {where}' if where else ''}")


def _caller() -> str | None:
    """``file:line in function`` of the first frame outside torch and the harness: the code that called the model
    (the recipe), where an autocast seen at the model's forward was entered."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not module.startswith(("torch", "harness.", "contextlib")):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _autocast_enabled(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch before 2.4: no device argument
        return bool(torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled())


def _autocast_dtype(device_type: str) -> torch.dtype:
    try:
        return torch.get_autocast_dtype(device_type)
    except (AttributeError, TypeError):
        return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


def rank_body(run: RunSpec, windows: scenarios.Windows, digest: str | None = None,
              find_unused: bool = False, max_norm: float | None = None,
              start: torch.Tensor | np.ndarray | None = None) -> list[WindowRecord]:
    """Runs on every rank: ``run``'s recipe on its model wrapped by its strategy (counting synchronizations), window
    after window; ``digest`` is the fingerprint of the initial weights every rank must rebuild (None: the built-in
    model, deterministic), ``find_unused`` whether parameters may miss a gradient in a backward, ``max_norm`` what
    a clipping recipe clips to (:func:`harness.recipes.contract.clips`), ``start`` the flat weights the run starts
    from (:mod:`harness.battery.start`, computed once by the parent, as a numpy array: a tensor argument would travel
    through a shared-memory file per rank and launch; None: the initial weights)."""
    import torch.distributed as dist

    from harness.distributed import strategies
    from harness.recipes import load_recipe
    from harness.recipes.contract import COMM_HOOK_OWNED, ContractViolation

    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if run.device == "cuda" else torch.device("cpu")
    recipe = load_recipe(run.recipe)
    spec = ModelSpec.of(run, digest)
    model = spec.build()
    spec.check_weights(model, f"rank {rank}")
    load_start(model, start)  # the parent's warmed weights, bitwise: no rank recomputes them with other sums
    model = model.to(dev)

    def refuse_comm_hook() -> None:
        raise ContractViolation(COMM_HOOK_OWNED)

    # The bf16 lane: FSDP2 computes in bf16 through its own policy (reducing in float32); DDP has none, so the
    # recipe runs under autocast, as a bf16 DDP training loop does.
    low = run.precision == "bf16"
    wrapped = strategies.get(run.strategy).wrap(model, dev, find_unused=find_unused,
                                                reduction=declared_reduction(recipe, run.reduction),
                                                on_comm_hook=refuse_comm_hook,
                                                mixed_precision=torch.bfloat16 if low else None)
    autocast_bf16 = low and run.strategy != "fsdp2"
    ddp = wrapped.module
    autocast = _AutocastSeen(dev.type)
    model.register_forward_pre_hook(autocast)
    passes = Passes()  # what the window's note reports: a rank that skipped its backward is named by it
    passes.attach(model)
    ddp.train()
    setup = getattr(recipe, "setup", None)
    if setup is not None:
        setup()
    records = []
    for k, window in enumerate(windows):
        mine = [spec.batch(mb.to(dev)) for mb in window[rank]]
        for p in model.parameters():
            p.grad = None
        before = wrapped.full_params()
        tensors = [local(p.detach()).clone() for p in model.parameters()]
        autocast.seen = None
        passes.reset()
        rngs, threads, env = _rng_states(), torch.get_num_threads(), dict(os.environ)
        wrapped.reset_syncs()
        error = None
        logged = None
        norm = None
        try:
            with torch.autocast(dev.type, dtype=torch.bfloat16) if autocast_bf16 else contextlib.nullcontext():
                if max_norm is None:
                    out = recipe.backward_window(ddp, mine)  # type: ignore[arg-type]
                else:
                    out = recipe.backward_window(ddp, mine, max_norm=max_norm)  # type: ignore[call-arg,arg-type]
                if isinstance(out, tuple) and len(out) == 2:
                    out, norm = out[0], None if out[1] is None else _as_float(out[1])
            logged = None if out is None else float(out)
        except ValueError as exc:
            error = f"ValueError: {exc}"
        except AttributeError as exc:
            mismatch = strategy_mismatch(str(exc), run.strategy)
            if mismatch is None:
                raise
            raise ContractViolation(mismatch) from exc
        left = _grads_left(model)
        launcher.progress(k, window_note(k, wrapped.syncs, passes, left, error), collectives=wrapped.syncs)
        moved, notes = _moved(rngs, _rng_states()), _settings_notes(threads, env)
        grads = tuple(str(p.grad.dtype) for p in model.parameters() if p.grad is not None)
        touched = float((wrapped.full_params() - before).abs().max()) if before.numel() else 0.0
        edited = _changed(tensors, model)
        grad = wrapped.full_grad() if error is None else None
        if error is None:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-LR)
        records.append(
            WindowRecord(
                grad=grad, params_before=before, params_after=wrapped.full_params(), syncs=wrapped.syncs,
                logged=logged, error=error, mode_changed=not (ddp.training and model.training), grad_dtypes=grads,
                rng_changed=moved, grads_left=left, weights_touched=touched, notes=notes, weights_changed=edited,
                autocast=autocast.seen, grad_norm=norm, strategy_notes=wrapped.notes(),
            )
        )
        if error is not None:
            break  # the window was refused; DDP may hold a half-prepared reduction, so stop here
    del ddp, wrapped  # before the process group goes away (a DDP module alive then can keep the rank from exiting)
    return records


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


@dataclass(frozen=True)
class Chain:
    """The reference chain of a run, and what computing it found about the model."""

    references: list[Reference | None]
    used: list[list[list[frozenset[str]]]]
    """``used[k][rank][microbatch]``: the parameters that received a gradient in that microbatch's backward (empty
    lists for a window without any token, which has no reference)."""
    trainable: tuple[str, ...]
    """The parameters that require grad."""
    model_error: str | None = None
    """The model's own error on the first microbatch it could not run (the chain stops there)."""
    starts: list[torch.Tensor] = field(default_factory=list)
    """The flat weights each window's reference was taken at (model order)."""
    max_norm: float | None = None
    """What a clipping recipe clips to (None: the chain does not clip); each reference gradient is then clipped."""
    norms: list[float | None] = field(default_factory=list)
    """Each window's reference gradient norm before clipping (a clipping chain only)."""


def reference_chain(windows: scenarios.Windows, precision: str, init_seed: int | None = None,
                    spec: ModelSpec | None = None) -> list[Reference | None]:
    """The single-device gradient of each window, stepping the same SGD between windows (None: no token at all);
    ``spec`` gives the model and batch convention (None: the built-in model, harness batches)."""
    chain = compute_chain(windows, precision, init_seed, spec)
    if chain.model_error is not None:
        raise RuntimeError(chain.model_error)
    return chain.references


def compute_chain(windows: scenarios.Windows, precision: str, init_seed: int | None = None,
                  spec: ModelSpec | None = None, objective: Objective = PLAIN, *, clip: bool = False,
                  start: torch.Tensor | None = None) -> Chain:
    """:func:`reference_chain` with what it saw: the parameters each microbatch reached, and, for a user's model, the
    model's own error on a microbatch it cannot run (the harness's built-in model raises instead: that is a bug).

    ``clip``: the recipe clips (:func:`harness.recipes.contract.clips`). ``max_norm`` is then :data:`CLIP_FRACTION`
    of the first reference gradient's norm, so that clipping engages, and each reference gradient is clipped the
    way ``torch.nn.utils.clip_grad_norm_`` clips (by ``min(1, max_norm / (norm + 1e-6))``) before the chain steps
    on it. ``start``: the flat weights the chain starts from (:mod:`harness.battery.start`; None: the initial
    weights), cast to the chain's precision."""
    from harness.battery.facts import rank_threads

    spec = spec or ModelSpec(None, HARNESS, init_seed, precision)
    with rank_threads():
        model = load_start(spec.build(), start)
        trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
        refs: list[Reference | None] = []
        used: list[list[list[frozenset[str]]]] = []
        starts: list[torch.Tensor] = []
        norms: list[float | None] = []
        max_norm: float | None = None
        current: list[Microbatch] = []

        def loss_of(m: torch.nn.Module, mb: Microbatch) -> torch.Tensor:
            current[:] = [mb]
            return spec.loss_sum(m, mb)

        def terms_of(m: torch.nn.Module, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor | None]:
            from harness.battery.objective import terms

            current[:] = [mb]
            return terms(spec, objective, m, mb)

        for k, window in enumerate(windows):
            if sum(mb.supervised for rank in window for mb in rank) == 0:
                refs.append(None)
                used.append([[] for _ in window])
                starts.append(flat_params(model))
                norms.append(None)
                continue
            seen: list[frozenset[str]] = []
            starts.append(flat_params(model))
            try:
                ref = (reference_gradient(model, window, loss_of, used=seen) if objective.plain else
                       reference_gradient(model, window, used=seen, objective=objective, terms_of=terms_of))
            except Exception as exc:
                if spec.path is None:
                    raise
                mb = current[0] if current else window[0][0]
                where = next(((r, m) for r, mbs in enumerate(window) for m, x in enumerate(mbs) if x is mb), (0, 0))
                rows, positions = mb.inputs.shape
                text = str(exc).strip().splitlines()
                error = (f"the model cannot run window {k}, rank {where[0]}'s microbatch {where[1]} ({rows} row"
                         f"{'s' if rows != 1 else ''} x {positions} position{'s' if positions != 1 else ''}): "
                         f"{type(exc).__name__}: {text[0] if text else ''}")
                return Chain(refs, used, trainable, model_error=error, starts=starts)
            if clip:
                norm = float(torch.linalg.vector_norm(ref.gradient))
                max_norm = CLIP_FRACTION * norm if max_norm is None else max_norm
                norms.append(norm)
                ref = replace(ref, gradient=ref.gradient * min(1.0, max_norm / (norm + 1e-6)))
            refs.append(ref)
            it = iter(seen)
            used.append([[next(it) for _ in mbs] for mbs in window])
            with torch.no_grad():
                offset = 0
                for p in model.parameters():
                    n = p.numel()
                    p.add_(ref.gradient[offset : offset + n].view_as(p), alpha=-LR)
                    offset += n
    return Chain(refs, used, trainable, starts=starts, max_norm=max_norm, norms=norms if clip else [])


_DDP_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def _named_indices(exc: LaunchError, trainable: tuple[str, ...]) -> tuple[str, ...]:
    """DDP names the parameters that got no gradient by index only (its names need TORCH_DISTRIBUTED_DEBUG, whose
    DETAIL level crashes forkserver ranks): the names, in the order DDP counts them (the parameters that require
    grad)."""
    out = []
    for rank, indices in sorted(set(_DDP_INDICES.findall("\n".join(exc.details.values())))):
        names = [trainable[int(i)] for i in indices.split() if int(i) < len(trainable)]
        if names:
            out.append(f"DDP's parameter indices {', '.join(indices.split())} without a gradient on rank {rank} are "
                       f"the model's {', '.join(names)}")
    return tuple(out)


def token_mean_at(run: Run, params: torch.Tensor, window: int) -> float:
    """The global token mean of ``window`` at the weights ``params`` (flat, model order): what a logged loss must be
    when the recipe started the window from those weights, right or wrong. At the weights the reference was taken
    at, it is the reference's own loss (the same forward passes, in the same order)."""
    ref = run.references[window] if window < len(run.references) else None
    if ref is not None and window < len(run.reference_starts) and torch.equal(run.reference_starts[window], params):
        return ref.loss
    from harness.battery.facts import rank_threads

    model = run.model_at(params)
    if not run.objective.plain:  # the declared objective's value (its auxiliary term included)
        from harness.battery.objective import value_at

        with rank_threads():
            return value_at(run.spec, run.objective, model, run.windows[window])
    with torch.no_grad(), rank_threads():
        total, count = 0.0, 0
        for rank in run.windows[window]:
            for mb in rank:
                total += float(run.loss_sum(model, mb))
                count += mb.supervised
    return total / count


_CACHE: dict[RunSpec, Run] = {}


def run(recipe: str | RunSpec, scenario: str | None = None, world_size: int | None = None, precision: str = "fp32",
        **options: object) -> Run:
    """Launch a run on its named scenario, cached per :class:`~harness.battery.options.RunSpec` for the session:
    ``run(spec)``, or ``run(recipe, scenario, world_size, precision, **options)`` with the spec's other fields as
    keywords (``model``, ``batch_format``, ``strategy``, ``find_unused``, ``deadline``, ...)."""
    if isinstance(recipe, RunSpec):
        spec = recipe
    else:
        if scenario is None or world_size is None:
            msg = "run(recipe, scenario, world_size, ...) needs the scenario and the world size (or pass a RunSpec)"
            raise TypeError(msg)
        spec = RunSpec(recipe, scenario, world_size, precision, **options)  # type: ignore[arg-type]
    if spec not in _CACHE:
        _CACHE[spec] = launch_run(spec, scenarios.build(spec.scenario, spec.world_size), share_chain=True)
    return _CACHE[spec]


def run_windows(recipe: str, windows: scenarios.Windows, precision: str = "fp32", *, scenario: str = "custom",
                env: dict[str, str] | None = None, **options: object) -> Run:
    """Launch ``recipe`` on explicit ``windows[k][rank][microbatch]`` (world size = ranks per window); not cached.
    ``options`` are :class:`~harness.battery.options.RunSpec`'s other fields (``model``, ``batch_format``,
    ``init_seed``, ``reduction``, ``strategy``, ``find_unused``, ``deadline``, ``device``, ``backend``)."""
    if not windows or len({len(w) for w in windows}) != 1:
        msg = "windows must be a non-empty list of windows with the same number of ranks each"
        raise ValueError(msg)
    spec = RunSpec(recipe, scenario, len(windows[0]), precision, **options)  # type: ignore[arg-type]
    return launch_run(spec, windows, env=env)


_NOISE: dict[tuple[object, ...], Any] = {}
"""The bf16 lane's measured noise (:class:`harness.battery.bf16.Noise`) by case, model, objective and strategy."""

_CHAINS: dict[tuple[object, ...], Chain] = {}
"""Reference chains of named scenarios, by (scenario, world size, model spec): every recipe judged on one case (the
recipe under test and each negative control) is compared with the same reference, computed once per process."""


@dataclass(frozen=True)
class Prepared:
    """What the parent decides before any rank starts, for one run: the model the ranks build (with the fingerprint
    of its initial weights when it is a user's), the reference chain, whether DDP needs ``find_unused_parameters``
    (``wrap``), and what the harness found about the model (``notes``, ``computes_in``). Both launchers use it: the
    in-process one (:func:`launch_run`) and torchrun's workers (:mod:`harness.battery.dist`)."""

    spec: RunSpec
    windows: scenarios.Windows
    model: ModelSpec
    chain: Chain
    wrap: bool
    notes: tuple[str, ...]
    computes_in: str | None
    objective: Objective = PLAIN
    noise: Any = None
    """The bf16 lane's measured noise and bound (:class:`harness.battery.bf16.Noise`); None in the other lanes."""
    start: torch.Tensor | None = None
    """The flat weights the ranks and the reference start from (:mod:`harness.battery.start`); None: the initial
    weights."""

    @property
    def digest(self) -> str | None:
        return self.model.digest

    def run(self, records: list[list[WindowRecord]] | None = None, **fields: Any) -> Run:
        """The :class:`Run` of this preparation with the ranks' ``records`` (or a ``failure`` / ``model_error``)."""
        s, chain = self.spec, self.chain
        fields.setdefault("notes", self.notes)
        return Run(s.recipe, s.scenario, s.world_size, s.precision, self.windows, records, chain.references,
                   init_seed=s.init_seed, model_path=s.model, batch_format=s.batch_format,
                   computes_in=self.computes_in, reference_starts=chain.starts, run_spec=s,
                   find_unused=self.wrap, objective=self.objective, max_norm=chain.max_norm,
                   reference_norms=chain.norms, bf16=self.noise, **fields)

    def failed(self, exc: LaunchError) -> Run:
        """The run whose ranks failed with ``exc`` (DDP's parameter indices named)."""
        return self.run(None, failure=exc, notes=self.notes + _named_indices(exc, self.chain.trainable))


def prepare(spec: RunSpec, windows: scenarios.Windows, *, share_chain: bool = False) -> Prepared:
    """The parent's half of a run (:class:`Prepared`), before any rank starts. ``share_chain``: ``windows`` are the
    named scenario's own (:func:`harness.battery.scenarios.build`), so the reference chain computed for another recipe
    on the same case is reused."""
    if spec.world_size != len(windows[0]):
        msg = f"spec.world_size={spec.world_size} but the windows have {len(windows[0])} ranks"
        raise ValueError(msg)
    from harness.distributed import strategies

    strategies.get(spec.strategy)  # an unknown name is refused here, not in every rank
    from harness.battery.objective import resolve, windows_for

    objective = resolve(spec.objective, spec.recipe)
    windows = windows_for(spec, windows)  # the objective's factors, drawn where the windows carry none
    model = ModelSpec.of(spec)
    notes: tuple[str, ...] = ()
    # Every lane starts from the warmed weights of the ranks' own precision (the bf16 lane: float32, its float64
    # truth the same numbers cast), so that per-token losses differ (harness.battery.start).
    start = start_weights(model)
    if start_note(model):
        notes += (str(start_note(model)),)
    computes_in = None
    found = None
    if spec.model is not None:  # every rank must rebuild the weights the reference starts from
        from harness.battery.facts import probe_model

        digest = weights_digest(model.build())
        found = probe_model(model)
        computes_in = found.computes_in
        notes = found.notes(unused=False) + notes  # the chain says which parameters miss a gradient, and where
        model = ModelSpec.of(spec, digest)
    from harness.recipes import load_recipe
    from harness.recipes.contract import clips

    clip = clips(load_recipe(spec.recipe))
    # The bf16 lane is judged against float64: its chain is the float64 one, and its bound comes from the noise.
    truth = replace(model, precision="fp64") if spec.precision == "bf16" else model
    key = (spec.scenario, spec.world_size, truth, objective, clip, spec.precision)  # bf16 starts at float32's weights
    chain = _CHAINS.get(key) if share_chain else None
    if chain is None:
        chain = compute_chain(windows, truth.precision, spec.init_seed, truth, objective, clip=clip, start=start)
        if share_chain and len(_CHAINS) < 64:
            _CHAINS[key] = chain
    noise = None
    if spec.precision == "bf16" and chain.model_error is None:
        from harness.battery import bf16

        noise_key = (spec.scenario, spec.world_size, model, objective, spec.strategy)
        noise = _NOISE.get(noise_key) if share_chain else None
        if noise is None:
            noise = bf16.measure_noise(model, windows, spec.strategy,
                                       lambda m: bf16.gradient_function(m, objective), objective)
            if share_chain and len(_NOISE) < 64:
                _NOISE[noise_key] = noise
    wrap = False
    if chain.model_error is None:
        needs, unused = unused_notes(chain, found.gradless if found is not None else ())
        wrap = spec.find_unused == "on" or (spec.find_unused == "auto" and needs)
        if needs:
            how = ("the ranks' DDP runs with it here (--find-unused-parameters auto), and your training code needs "
                   "it too, or every parameter a gradient" if wrap else
                   "the ranks' DDP runs without it here (--find-unused-parameters off): DDP then never finishes the "
                   "reduction of a rank that misses a gradient while the others wait for it (use auto or on)")
            if spec.strategy == "fsdp2":
                notes += (*unused, "under FSDP2 the ranks shard the model as one group here (a module no forward "
                          "reaches is never gathered, and its gradients cannot be accumulated under a "
                          "mixed-precision policy); under DDP it needs find_unused_parameters=True")
            else:
                notes += (*unused, f"the model therefore needs DDP's find_unused_parameters=True: {how}")
    return Prepared(spec, windows, model, chain, wrap, notes, computes_in, objective, noise, start)


def launch_run(spec: RunSpec, windows: scenarios.Windows, env: dict[str, str] | None = None, *,
               share_chain: bool = False) -> Run:
    """Launch ``spec`` on ``windows`` through the in-process launcher: :func:`prepare`, then the ranks (not cached).

    ``reduction="sum"`` makes the harness's comm hook sum gradients instead of averaging them (DDP's default);
    ``init_seed`` draws other initial weights (the same on every rank and in the reference). ``model``
    (``"pkg.mod:factory"``) builds the user's model on every rank and for the reference, from the same seed;
    ``batch_format="hf"`` gives the recipe the dicts of :func:`harness.core.formats.to_hf`. ``find_unused``: see
    :data:`FIND_UNUSED`; ``strategy``: the data-parallel strategy the ranks wrap the model with
    (:mod:`harness.distributed.strategies`). A user's model that cannot run one of the microbatches gives a run with
    ``model_error`` set and no launch.
    """
    ready = prepare(spec, windows, share_chain=share_chain)
    if ready.chain.model_error is not None:
        return ready.run(None, model_error=ready.chain.model_error)
    preload = tuple(m for m in (recipe_module(spec.recipe), *model_modules(spec.model)) if m)
    try:
        records = launch(rank_body, spec.world_size, spec, ready.windows, ready.digest, ready.wrap,
                         ready.chain.max_norm, None if ready.start is None else ready.start.numpy(),
                         deadline=spec.deadline, backend=spec.backend, device=spec.device, env=env, preload=preload,
                         lockstep_grace=LOCKSTEP_GRACE, nodes=spec.nodes)
    except LaunchError as exc:
        return ready.failed(exc)
    return ready.run(records)


__all__ = [
    "DEADLINE",
    "FIND_UNUSED",
    "SKIP_SYNC",
    "Chain",
    "Prepared",
    "Run",
    "RunSpec",
    "WindowRecord",
    "check_find_unused",
    "compute_chain",
    "declared_reduction",
    "launch_run",
    "prepare",
    "rank_body",
    "reference_chain",
    "run",
    "run_windows",
    "strategy_mismatch",
    "token_mean_at",
    "unused_notes",
]
