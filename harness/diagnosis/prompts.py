"""The prompt family of readings: a loss whose labels were rebuilt from the input ids, so that every real position is
supervised, the prompt's included (``prompt_supervised``).

The window's batches mark a prompt's positions unsupervised (``IGNORE_INDEX``); their targets are still known, the
next input token. Each microbatch's gradient of its prompt positions' loss is fitted beside the blocks' own
(:func:`harness.diagnosis.packed.fit_beside`): a gradient that the blocks at one common weight and the prompt columns
at that same weight explain is the loss over every real position, divided by whatever count the sentence names
(``N + P``, the rebuilt labels' own count, where the recipe counted them too). Read on the harness's batch format under
the token mean, where the positions' targets are the next input ids.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from harness.core.compare import flat_grad
from harness.core.formats import HARNESS
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.fit import MAX_CONDITION, Block, Fit, explained_residual, match_tolerance
from harness.diagnosis.packed import fit_beside
from harness.diagnosis.signatures import Signature, classify


def prompt_labels(mb: Microbatch) -> torch.Tensor:
    """The labels of ``mb``'s prompt positions alone: at each real position that is not supervised and whose next
    position is real, the next input id; ``IGNORE_INDEX`` elsewhere."""
    real = mb.inputs != PAD
    nxt = torch.full_like(mb.inputs, PAD)
    nxt[:, :-1] = mb.inputs[:, 1:]
    prompt = real & (mb.labels == IGNORE_INDEX) & (nxt != PAD)
    return torch.where(prompt, nxt, torch.full_like(mb.labels, IGNORE_INDEX))


def prompt_columns(ev: Evidence, model: torch.nn.Module, mbs: Sequence[Microbatch]) -> tuple[torch.Tensor, int] | None:
    """``([components, blocks], P)``: each microbatch's gradient of its prompt positions' loss sum (zero without one)
    and the window's prompt positions P; None where no microbatch has one."""
    cols, size, prompts = [], sum(p.numel() for p in model.parameters()), 0
    for mb in mbs:
        labels = prompt_labels(mb)
        count = int((labels != IGNORE_INDEX).sum())
        if not count:
            cols.append(torch.zeros(size, dtype=torch.float64))
            continue
        prompts += count
        model.zero_grad(set_to_none=True)
        ev.model.loss_sum(model, Microbatch(mb.inputs, labels)).backward()
        cols.append(flat_grad(model).double())
    return None if not prompts else (torch.stack(cols, dim=1), prompts)


def prompt_reading(ev: Evidence, model: torch.nn.Module, a: torch.Tensor, g: torch.Tensor, blocks: Sequence[Block],
                   mbs: Sequence[Microbatch], rank: int, others: Mapping[str, int]) -> tuple[Fit, Signature] | None:
    """``(the blocks' fit, prompt_supervised)`` when ``g`` is the blocks and their prompt positions at one common
    weight (the harness's batch format, the token mean, one token rank per data rank); None otherwise."""
    if ev.batch_format != HARNESS or not ev.objective.plain or ev.mesh.size("cp") > 1:
        return None
    found = prompt_columns(ev, model, mbs)
    if found is None:
        return None
    extra, prompts = found
    fit, u, joint = fit_beside(a, g, extra)
    if joint.residual > explained_residual() or not joint.condition <= MAX_CONDITION:
        return None
    sig = classify(blocks, fit, ev.mesh.token_ranks, ev.precision, rank=ev.mesh.token_rank(rank),
                   other_counts=others)
    if sig.name not in ("correct", "float32_computation", "global_scale"):
        return None
    n = sum(b.tokens for b in blocks)
    c = sig.factor if sig.factor is not None else 1.0
    live = [float(w) * n for w, col in zip(u, extra.T) if bool(col.any()) and math.isfinite(float(w))]
    if not live or max(abs(r / c - 1) for r in live) > match_tolerance():
        return None
    counted = ("every supervised token and prompt position weighs 1/(N + P): the rebuilt labels' own count"
               if abs(c * (n + prompts) / n - 1) <= match_tolerance() else
               f"every supervised token and prompt position weighs {c:.4g}/N")
    words = (f"the gradient holds the loss of the {prompts} prompt positions beside the {n} supervised tokens (N={n}, "
             f"P={prompts}): {counted}; labels rebuilt from the input ids supervise the prompt, which the batch's "
             "labels mark -100")
    return fit, Signature("prompt_supervised", words, c)


__all__ = ["prompt_columns", "prompt_labels", "prompt_reading"]
