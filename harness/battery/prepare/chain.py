"""The reference chain: the single-device gradient of each window of a run, stepping the same SGD between windows
as the ranks do, and what computing it found about the model (the parameters each microbatch reached, the model's own
error on a microbatch it cannot run). Computed in the parent before any rank starts
(:mod:`harness.battery.prepare.steps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from harness.battery import scenarios
from harness.battery.prepare.objective import AuxiliaryError, terms
from harness.battery.prepare.probe.facts import rank_threads
from harness.battery.prepare.start import load as load_start
from harness.battery.spec import ModelSpec
from harness.core.compare import flat_params
from harness.core.formats import HARNESS
from harness.core.microbatch import Microbatch
from harness.core.objectives import PLAIN, Objective
from harness.core.reference import Reference, reference_gradient
from harness.core.router_terms import DeclarationError

LR = 0.1
"""SGD step between windows (plain SGD: the battery checks gradients, not optimizer state)."""

CLIP_FRACTION = 0.5
"""A clipping recipe clips to this fraction of the first window's reference gradient norm: below every norm it is
judged at would check nothing of the clipping."""


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
    on it. ``start``: the flat weights the chain starts from (:mod:`harness.battery.prepare.start`; None: the initial
    weights), cast to the chain's precision."""
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

        def terms_of(m: torch.nn.Module, mb: Microbatch) -> tuple[torch.Tensor, object]:
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
                if spec.path is None or isinstance(exc, DeclarationError | AuxiliaryError):  # the recipe's error
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
