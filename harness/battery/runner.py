"""Run a recipe on real ranks over a scenario's windows, and compute the single-device reference beside it.

Rank side (:func:`rank_body`): the model wrapped in DDP with the harness's counting hook, the recipe's
``backward_window`` per window, then what every check needs: the synchronized gradient, the parameters after an SGD
step, the synchronization count, the logged loss, and whether the recipe touched the RNG state or the model's mode.
Parent side (:func:`run`): the launch with a deadline, the reference chain, and a cache so that the checks sharing a
run (parity, rank agreement, sync count, logged loss) launch it once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness import scenarios
from harness.batching import Microbatch
from harness.compare import flat_grad, flat_params
from harness.launcher import LaunchError, launch
from harness.model import build_model
from harness.reference import Reference, reference_gradient

LR = 0.1
"""SGD step between windows (plain SGD: the battery checks gradients, not optimizer state)."""

DEADLINE = 30.0
"""Seconds one battery run may take; a recipe that hangs is reported at this deadline, never waited on longer."""

PRECISIONS = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class WindowRecord:
    """What one rank saw after one window."""

    grad: torch.Tensor | None
    params_before: torch.Tensor
    params_after: torch.Tensor
    syncs: int
    logged: float | None
    error: str | None
    """``"ValueError: ..."`` when the recipe raised ValueError (the contract's answer to an empty window)."""
    rng_changed: bool
    mode_changed: bool
    grad_dtypes: tuple[str, ...]


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

    def label(self, window: int | None = None) -> str:
        where = f", window {window}" if window is not None else ""
        return f"recipe {self.recipe}, world {self.world_size}{where}, {self.precision}, scenario {self.scenario}"


def rank_body(
    recipe_path: str, windows: scenarios.Windows, precision: str, device: str, reduction: str = "mean"
) -> list[WindowRecord]:
    """Runs on every rank: the recipe under DDP with the counting hook, window after window."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from harness.hooks import attach
    from harness.recipes import load_recipe

    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    recipe = load_recipe(recipe_path)
    model = build_model(scenarios.BATTERY_CONFIG).to(PRECISIONS[precision]).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    counter = attach(ddp, reduction)
    ddp.train()
    records = []
    for window in windows:
        mine: list[Microbatch] = [mb.to(dev) for mb in window[rank]]
        for p in model.parameters():
            p.grad = None
        before = flat_params(model)
        rng = torch.get_rng_state()
        counter.syncs = 0
        error = None
        logged = None
        try:
            out = recipe.backward_window(ddp, mine)
            logged = None if out is None else float(out)
        except ValueError as exc:
            error = f"ValueError: {exc}"
        grads = tuple(str(p.grad.dtype) for p in model.parameters() if p.grad is not None)
        grad = flat_grad(model) if error is None else None
        if error is None:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-LR)
        records.append(
            WindowRecord(
                grad=grad, params_before=before, params_after=flat_params(model), syncs=counter.syncs,
                logged=logged, error=error, rng_changed=not torch.equal(rng, torch.get_rng_state()),
                mode_changed=not (ddp.training and model.training), grad_dtypes=grads,
            )
        )
        if error is not None:
            break  # the window was refused; DDP may hold a half-prepared reduction, so stop here
    del ddp
    return records


def reference_chain(windows: scenarios.Windows, precision: str) -> list[Reference | None]:
    """The single-device gradient of each window, stepping the same SGD between windows (None: no token at all)."""
    model = build_model(scenarios.BATTERY_CONFIG).to(PRECISIONS[precision])
    refs: list[Reference | None] = []
    for window in windows:
        if sum(mb.supervised for rank in window for mb in rank) == 0:
            refs.append(None)
            continue
        ref = reference_gradient(model, window)
        refs.append(ref)
        with torch.no_grad():
            offset = 0
            for p in model.parameters():
                n = p.numel()
                p.add_(ref.gradient[offset : offset + n].view_as(p), alpha=-LR)
                offset += n
    return refs


_CACHE: dict[tuple[str, str, int, str, str, str, str], Run] = {}


def run(recipe: str, scenario: str, world_size: int, precision: str = "fp32", *, device: str = "cpu",
        backend: str = "gloo", deadline: float = DEADLINE, reduction: str = "mean") -> Run:
    """Launch ``recipe`` on the named ``scenario`` (cached per arguments for the session)."""
    key = (recipe, scenario, world_size, precision, device, backend, reduction)
    if key not in _CACHE:
        windows = scenarios.build(scenario, world_size)
        _CACHE[key] = run_windows(recipe, windows, precision, scenario=scenario, device=device, backend=backend,
                                  deadline=deadline, reduction=reduction)
    return _CACHE[key]


def run_windows(recipe: str, windows: scenarios.Windows, precision: str = "fp32", *, scenario: str = "custom",
                device: str = "cpu", backend: str = "gloo", deadline: float = DEADLINE,
                reduction: str = "mean") -> Run:
    """Launch ``recipe`` on explicit ``windows[k][rank][microbatch]`` (world size = ranks per window); not cached.

    ``reduction="sum"`` makes the harness's comm hook sum gradients instead of averaging them (DDP's default).
    """
    if precision not in PRECISIONS:
        msg = f"precision={precision!r} must be one of {sorted(PRECISIONS)}"
        raise ValueError(msg)
    if not windows or len({len(w) for w in windows}) != 1:
        msg = "windows must be a non-empty list of windows with the same number of ranks each"
        raise ValueError(msg)
    world_size = len(windows[0])
    references = reference_chain(windows, precision)
    try:
        records = launch(rank_body, world_size, recipe, windows, precision, device, reduction, deadline=deadline,
                         backend=backend, device=device)
        return Run(recipe, scenario, world_size, precision, windows, records, references)
    except LaunchError as exc:
        return Run(recipe, scenario, world_size, precision, windows, None, references, failure=exc)


def clear_cache() -> None:
    _CACHE.clear()


__all__ = ["Run", "WindowRecord", "clear_cache", "rank_body", "reference_chain", "run", "run_windows"]
