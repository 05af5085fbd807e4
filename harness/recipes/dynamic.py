"""Dynamic micro-batches: a rank's window re-split by a token budget, and the correct recipe over them.

verl's ``use_dynamic_bsz`` does not keep the micro-batches it is given: ``rearrange_micro_batches`` re-splits each
rank's rows into micro-batches of at most ``ppo_max_token_len_per_gpu`` tokens, rows kept whole, so a rank of long
rows runs more micro-batches than a rank of short ones, and the micro-batch count is no longer a constant of the
configuration. :func:`split_by_tokens` does that re-split (first fit, in row order); :class:`DynamicTokenMean` is the
recipe that stays right over it:

- the count is the window's, all-reduced over every rank before the first backward (never a micro-batch's own, never
  divided by this rank's micro-batch count, which other ranks do not share);
- every micro-batch but the last of *this rank's own* runs under ``no_sync()``, and the last synchronizes: one
  synchronization per window on every rank, whatever each rank's count;
- every rank calls the same collectives in the same order: under DDP a ``no_sync()`` pass calls none, so ranks may
  run different numbers of passes; under FSDP2 every forward all-gathers the parameters, so the count is made the
  same on every rank first (the largest, all-reduced: verl's ``same_micro_num_in_dp``).

Run it: ``python -m harness battery --recipe harness.recipes.dynamic:dynamic_token_mean``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from harness.core.loss import count_device, global_token_loss
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.recipes.correct import _world_size, forward_loss_sum, global_sum, window_count
from harness.recipes.helpers import sync_context

TOKEN_BUDGET = 256
"""The recipes' token budget per micro-batch (verl's ``ppo_max_token_len_per_gpu``): twice the battery's longest
sequence, so a rank of the longest rows runs several micro-batches and a rank of short rows one or two."""


def row_length(mb: Microbatch, i: int) -> int:
    """Row ``i``'s tokens as a budget counts them: its real positions, up to its last input that is not ``PAD`` or
    its last supervised target (what verl's ``attention_mask.sum(-1)`` gives a right-padded row)."""
    real = (mb.inputs[i] != PAD) | (mb.labels[i] != IGNORE_INDEX)
    where = real.nonzero()
    return int(where[-1]) + 1 if where.numel() else 0


def split_by_tokens(window: Sequence[Microbatch], budget: int, at_least: int = 1) -> list[Microbatch]:
    """The window's rows re-split into micro-batches of at most ``budget`` tokens (:func:`row_length`), rows kept
    whole: each row, in window order, goes to the first micro-batch it fits in, else opens a new one (first fit).
    Each micro-batch is padded to its own longest row. ``at_least``: the fewest micro-batches to return, the one with
    the most tokens split in two, in row order at half its tokens, until there are that many (FSDP2's equal count).

    ValueError naming the budget where a row is longer than it (verl asserts the same: raise
    ``ppo_max_token_len_per_gpu`` to the longest sequence at least), or where the window holds fewer rows than
    ``at_least``."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        msg = f"split_by_tokens(budget={budget!r}): the budget is a positive number of tokens per micro-batch"
        raise ValueError(msg)
    rows = [(mb, i, row_length(mb, i)) for mb in window for i in range(mb.inputs.shape[0])]
    if not rows:
        msg = "split_by_tokens(window=[]): a window holds at least one microbatch of at least one row"
        raise ValueError(msg)
    longest = max(n for _, _, n in rows)
    if longest > budget:
        raise ValueError(_too_long(budget, longest))
    if at_least > len(rows):
        msg = (f"split_by_tokens(at_least={at_least}): the window holds {len(rows)} rows, and a micro-batch needs one "
               "at least; lower the budget's count to match, or give every rank as many rows")
        raise ValueError(msg)
    groups = _first_fit(rows, budget)
    while len(groups) < at_least:  # at_least <= rows: some micro-batch still holds two rows
        at = max((j for j, g in enumerate(groups) if len(g) > 1), key=lambda j: sum(n for _, _, n in groups[j]))
        groups[at : at + 1] = _halves(groups[at])
    return [_collate(g) for g in groups]


Row = tuple[Microbatch, int, int]


def _too_long(budget: int, longest: int) -> str:
    return (f"split_by_tokens(budget={budget}): a row holds {longest} tokens, more than the budget; a row is never "
            f"cut, so raise the budget (ppo_max_token_len_per_gpu) to {longest} at least")


def _first_fit(rows: Sequence[Row], budget: int) -> list[list[Row]]:
    groups: list[list[Row]] = []
    held: list[int] = []
    for row in rows:
        at = next((j for j, h in enumerate(held) if h + row[2] <= budget), None)
        if at is None:
            groups.append([row])
            held.append(row[2])
        else:
            groups[at].append(row)
            held[at] += row[2]
    return groups


def _halves(rows: Sequence[Row]) -> list[list[Row]]:
    """Two micro-batches of ``rows`` (two rows at least), in order: the first takes rows while it holds at most half
    the tokens, and one row at least; the second the rest, one row at least."""
    half, cut, held = sum(n for _, _, n in rows) / 2, 1, rows[0][2]
    while cut < len(rows) - 1 and held + rows[cut][2] <= half:
        held += rows[cut][2]
        cut += 1
    return [list(rows[:cut]), list(rows[cut:])]


def _collate(rows: Sequence[Row]) -> Microbatch:
    """The rows as one microbatch padded to its longest row (padding after a row's end changes no loss of a causal
    model: its positions come after every real one, and are never supervised)."""
    if any(mb.positions is not None or mb.counts is not None for mb, _, _ in rows):
        msg = ("split_by_tokens: a microbatch holding part of its rows' positions (a cp chunk) is not re-split; "
               "split the whole sequences before sharding them over cp")
        raise ValueError(msg)
    width = max(1, max(n for _, _, n in rows))
    first = rows[0][0]
    inputs = torch.full((len(rows), width), PAD, dtype=torch.int64, device=first.inputs.device)
    labels = torch.full_like(inputs, IGNORE_INDEX)
    weighted = any(mb.weights is not None for mb, _, _ in rows)
    dtype = next((mb.weights.dtype for mb, _, _ in rows if mb.weights is not None), torch.float64)
    weights = torch.zeros(inputs.shape, dtype=dtype, device=inputs.device) if weighted else None
    for b, (mb, i, n) in enumerate(rows):
        inputs[b, :n] = mb.inputs[i, :n]
        labels[b, :n] = mb.labels[i, :n]
        if weights is not None:
            weights[b, :n] = 1.0 if mb.weights is None else mb.weights[i, :n]
    return Microbatch(inputs, labels, weights)


def max_over_ranks(*values: int) -> tuple[int, ...]:
    """The largest of each of ``values`` over every rank, in one all-reduce (the identity outside a process group)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.int64, device=count_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(int(v) for v in t.tolist())


def gathers_every_forward(model: nn.Module) -> bool:
    """Whether every forward of ``model`` is a collective (an FSDP2 ``fully_shard`` model all-gathers its parameters):
    then every rank must run the same number of passes."""
    return not hasattr(model, "no_sync") and callable(getattr(model, "set_requires_gradient_sync", None))


def dynamic_microbatches(model: nn.Module, window: Sequence[Microbatch], budget: int) -> list[Microbatch]:
    """This rank's micro-batches under ``budget``: its own count under DDP (ranks may differ), the largest count of
    any rank under FSDP2 (so that every rank runs as many forwards, each an all-gather). One all-reduce of the
    longest row and the count over every rank comes first, so that a row over the budget on any rank is refused by
    every rank together (one rank raising alone would leave the others in their first synchronization)."""
    longest = max(row_length(mb, i) for mb in window for i in range(mb.inputs.shape[0]))
    own = len(split_by_tokens(window, budget)) if longest <= budget else 0
    longest, most = max_over_ranks(longest, own)
    if longest > budget:
        raise ValueError(_too_long(budget, longest))
    return split_by_tokens(window, budget, at_least=most if gathers_every_forward(model) else 1)


class DynamicTokenMean:
    """The global token mean over token-budget micro-batches (verl's ``use_dynamic_bsz`` written right): the count
    all-reduced over every rank before any backward, each micro-batch's loss sum times ``W / N``, ``no_sync()``
    around all of this rank's micro-batches but its last."""

    name = "dynamic_token_mean"
    budget = TOKEN_BUDGET
    """Tokens per micro-batch (verl's ``ppo_max_token_len_per_gpu``)."""

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        # The count first, on every rank, before any forward: a window without a supervised token is refused by
        # every rank together, and no micro-batch's count stands in for the window's.
        total, world = window_count(window), _world_size()
        parts = dynamic_microbatches(model, window, self.budget)
        local = 0.0
        for i, mb in enumerate(parts):
            # The last of this rank's own micro-batches synchronizes; the other ranks' counts do not matter here,
            # since a no_sync() pass calls no collective under DDP.
            with sync_context(model, i, len(parts)):
                s = forward_loss_sum(model, mb)
                global_token_loss(s, total, world).backward()
            local += float(s.detach())
        return global_sum(local) / total


dynamic_token_mean = DynamicTokenMean()

__all__ = ["TOKEN_BUDGET", "DynamicTokenMean", "dynamic_microbatches", "dynamic_token_mean", "gathers_every_forward",
           "max_over_ranks", "row_length", "split_by_tokens"]
