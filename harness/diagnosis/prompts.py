"""The prompt family of readings: a loss whose labels were rebuilt from the input ids, so that every real position is
supervised, the prompt's included (``prompt_supervised``).

The window's batches mark a prompt's positions unsupervised (``IGNORE_INDEX``); their targets are still known, the
next input token. Each microbatch's gradient of its prompt positions' loss is fitted beside the blocks' own
(:func:`harness.diagnosis.packed.fit_beside`): a gradient that the blocks at one common weight and the prompt columns
at that same weight explain is the loss over every real position, divided by whatever count the sentence names
(``N + P``, the rebuilt labels' own count, where the recipe counted them too). Read on the harness's batch format under
the token mean, where the positions' targets are the next input ids.

On a packed run (``--batch-format=packed``) labels rebuilt from the packed rows' ``input_ids`` (``labels =
input_ids``) supervise the prompt and the pairs across the sequences' boundaries alike: the prompt columns and the
boundary columns (:func:`harness.diagnosis.packed.boundary_columns`) are fitted beside the blocks together, and a
gradient they explain at one common weight ``1/(N + P + B)``, the rebuilt labels' count, reads
``shifted_and_counted_across_boundaries`` (:func:`packed_prompt_reading`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from harness.core.compare import flat_grad
from harness.core.formats import HARNESS, PACKED
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.fit import MAX_CONDITION, Block, Fit, explained_residual, match_tolerance
from harness.diagnosis.packed import boundary_columns, count_facts, fit_beside, named_count
from harness.diagnosis.signatures import Signature, classify, scale_tolerance


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
    if ev.batch_format == PACKED:
        return packed_prompt_reading(ev, model, a, g, blocks, mbs, rank, others)
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


def packed_prompt_reading(ev: Evidence, model: torch.nn.Module, a: torch.Tensor, g: torch.Tensor,
                          blocks: Sequence[Block], mbs: Sequence[Microbatch], rank: int,
                          others: Mapping[str, int]) -> tuple[Fit, Signature] | None:
    """``(the blocks' fit, shifted_and_counted_across_boundaries)`` when ``g`` is the blocks, their prompt positions
    and their boundary pairs all at the weight ``1/(N + P + B)``: labels rebuilt from a packed row's ``input_ids``
    and divided by their own count (a packed run under the token mean, one token rank per data rank); None
    otherwise."""
    if ev.batch_format != PACKED or not ev.objective.plain or ev.mesh.size("cp") > 1:
        return None
    found, pairs = prompt_columns(ev, model, mbs), boundary_columns(ev, model, mbs)
    if found is None or pairs is None:
        return None
    prompted, prompts = found
    extra = torch.cat([prompted, pairs], dim=1)
    fit, u, joint = fit_beside(a, g, extra)
    if joint.residual > explained_residual() or not joint.condition <= MAX_CONDITION:
        return None
    sig = classify(blocks, fit, ev.mesh.token_ranks, ev.precision, rank=ev.mesh.token_rank(rank),
                   other_counts=others)
    if sig.name != "global_scale" or sig.factor is None:
        return None
    c, facts = sig.factor, count_facts(mbs)
    n = facts.n
    live = [float(w) * n for w, col in zip(u, extra.T) if bool(col.any()) and math.isfinite(float(w))]
    if not live or max(abs(r / c - 1) for r in live) > match_tolerance():
        return None
    tol = scale_tolerance([float(w) * n for w in fit.weights], c, fit, ev.precision)
    named = named_count(facts, c, tol)
    if named is None or named[1] != "N + P + B" or facts.prompts != prompts:
        return None
    words = (f"the gradient holds the loss of the P={prompts} prompt positions and the B={facts.boundaries} pairs "
             f"across the packed sequences' boundaries beside the {n} supervised tokens, and every one of them weighs "
             f"1/(N + P + B) = 1/{named[0]} where 1/N is right (N={n}): labels rebuilt from the packed rows' input ids "
             "(labels = input_ids) supervise the prompt, which the batch's labels mark -100, and train every "
             "sequence's last token to predict the first token of the next sequence in its row (the separator "
             "dropped), and the loss was divided by their own count, N + P + B")
    return fit, Signature("shifted_and_counted_across_boundaries", words, c)


__all__ = ["packed_prompt_reading", "prompt_columns", "prompt_labels", "prompt_reading"]
