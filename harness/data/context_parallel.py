"""Context parallelism's data: which positions of a sequence each cp rank is supervised on.

Under context parallelism the cp ranks of one data coordinate split the positions of its sequences. Real stacks
shard the inputs and run an attention that gathers keys and values from the other shards; for the loss and its
count, what matters is which *labels* each rank holds. So each cp rank receives the coordinate's full microbatch and
is supervised on its own positions only (``IGNORE_INDEX`` elsewhere): the same gradient as real sequence sharding
with an attention that all-gathers K and V (measured to 1e-16, ``FACTS.md``'s mesh section), on any attention
kernel, CPU included. What it does not check is attention's numerics across shards.

Two chunkings, as real stacks cut a sequence of padded length ``T``:

- ``contiguous``: ``cp`` chunks in order; rank ``i`` holds chunk ``i`` (Megatron-LM without load balancing, verl);
- ``load_balanced``: ``2 * cp`` chunks; rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``, so that under a
  causal mask every rank does about the same work (torch's ``context_parallel`` and Megatron-LM's default).

Chunk ``j`` of ``n`` covers positions ``[j * T // n, (j + 1) * T // n)``: a partition of the positions for any
``T``, so every supervised token is held by exactly one cp rank.
"""

from __future__ import annotations

import torch

from harness.core.mesh import CHUNKINGS
from harness.core.microbatch import IGNORE_INDEX, Microbatch


def check_chunking(chunking: str, argument: str = "chunking") -> str:
    if chunking not in CHUNKINGS:
        msg = f"{argument}={chunking!r} must be one of {', '.join(CHUNKINGS)}"
        raise ValueError(msg)
    return chunking


def chunks_of(cp_rank: int, cp: int, chunking: str) -> tuple[int, ...]:
    """The chunk indices (of ``cp`` or ``2 * cp`` chunks) that cp rank ``cp_rank`` holds."""
    check_chunking(chunking)
    if not 0 <= cp_rank < cp:
        msg = f"cp_rank={cp_rank} is outside a cp dimension of size {cp}"
        raise ValueError(msg)
    if chunking == "contiguous":
        return (cp_rank,)
    return (cp_rank, 2 * cp - 1 - cp_rank)


def positions(length: int, cp_rank: int, cp: int, chunking: str = "contiguous") -> torch.Tensor:
    """A bool mask ``[length]``: the positions cp rank ``cp_rank`` of ``cp`` holds."""
    n = cp if chunking == "contiguous" else 2 * cp
    mask = torch.zeros(length, dtype=torch.bool)
    for j in chunks_of(cp_rank, cp, chunking):
        mask[j * length // n : (j + 1) * length // n] = True
    return mask


def shard_chunk(mb: Microbatch, cp_rank: int, cp: int, chunking: str = "contiguous") -> Microbatch:
    """``mb`` as cp rank ``cp_rank`` of ``cp`` receives it when its model shards the sequence itself: only the
    positions the rank holds (inputs, labels, per-token factors), with each column's position in the full sequence
    (``Microbatch.positions``), as real sequence sharding hands a rank its chunk. At ``cp == 1``, ``mb`` itself."""
    if cp == 1:
        return mb
    held = positions(mb.labels.shape[1], cp_rank, cp, chunking).to(mb.labels.device)
    index = held.nonzero().flatten()
    where = index.unsqueeze(0).expand(mb.labels.shape[0], -1).contiguous()
    weights = None if mb.weights is None else mb.weights[:, index]
    return Microbatch(mb.inputs[:, index], mb.labels[:, index], weights, where)


def supervise_chunk(mb: Microbatch, cp_rank: int, cp: int, chunking: str = "contiguous") -> Microbatch:
    """``mb`` as cp rank ``cp_rank`` of ``cp`` receives it: every row and position, supervised only where the rank
    holds the position (labels and per-token factors cleared elsewhere). At ``cp == 1``, ``mb`` itself."""
    if cp == 1:
        return mb
    held = positions(mb.labels.shape[1], cp_rank, cp, chunking).to(mb.labels.device)
    labels = torch.where(held, mb.labels, torch.full_like(mb.labels, IGNORE_INDEX))
    weights = None if mb.weights is None else torch.where(held, mb.weights, torch.zeros_like(mb.weights))
    return Microbatch(mb.inputs, labels, weights)
