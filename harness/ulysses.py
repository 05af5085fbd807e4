"""Ulysses sequence parallelism for the built-in model (``--model harness.ulysses:ulysses``): the sequence sharded over
the cp group, and around attention two all-to-alls, as DeepSpeed-Ulysses, VeOmni, ms-swift and verl do it over their
``sp`` group.

Each cp rank holds a chunk of every sequence (:func:`harness.data.context_parallel.shard_chunk`, with each column's
position in the full sequence) and computes its chunk's queries, keys and values for every head. The first
all-to-all trades heads for positions: rank ``r`` sends head group ``j`` of its chunk to rank ``j`` and receives head
group ``r`` of every rank's chunk, so it holds ``n_heads / cp`` heads over *all* positions; it runs causal attention
for those heads, masked by the positions themselves (either chunking, contiguous or load-balanced, gives the full
sequence's attention); the second all-to-all trades them back, and each rank again holds its chunk, every head.

:func:`harness.model.gathered_attention` (``harness.model:sequence_sharded``) gathers every rank's keys and values and
keeps every head; here no rank ever holds a head it does not attend with. For the loss and its count the two are the
same: each rank is supervised on its chunk's positions, and the gradients' sum over the cp ranks is the full
sequence's (docs/layout.md, "Ulysses sequence parallelism is cp for the recipe").

The all-to-all carries gradients (:class:`_AllToAll`: its backward is the reverse all-to-all). torch 2.13's gloo runs
``dist.all_to_all_single`` over a subgroup on the CPU with a size for each pair of ranks (its list ``all_to_all``
wants one shape for every part), so the chunks, whose lengths differ by a column where ``T`` is odd, need no
padding.

This module belongs to the model layer: it imports :mod:`harness.model` and the layers below.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.data.config import Config
from harness.model import Block, ModelError, TinyCausalLM, build_model


class _AllToAll(torch.autograd.Function):
    """``sends[j]`` goes to rank ``j`` of ``group``; returns what each rank sent this one, in rank order
    (``shapes[j]`` the shape of rank ``j``'s). Its gradient is the reverse all-to-all: each received part's gradient
    goes back to the rank that sent it."""

    @staticmethod
    def forward(ctx: Any, group: Any, shapes: tuple[torch.Size, ...], *sends: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.shapes = tuple(s.shape for s in sends)
        return _exchange([s.contiguous() for s in sends], shapes, group)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        back = _exchange([g.contiguous() for g in grads], ctx.shapes, ctx.group)
        return (None, None, *back)


def _exchange(sends: list[torch.Tensor], shapes: tuple[torch.Size, ...], group: Any) -> tuple[torch.Tensor, ...]:
    # gloo's list all_to_all wants one shape for every part; all_to_all_single takes a size per pair of ranks, so
    # the parts travel flat, one buffer each way.
    sizes = [math.prod(shape) for shape in shapes]
    flat = torch.cat([s.reshape(-1) for s in sends])
    out = torch.empty(sum(sizes), dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(out, flat, output_split_sizes=sizes, input_split_sizes=[s.numel() for s in sends],
                           group=group)
    return tuple(part.view(shape) for part, shape in zip(out.split(sizes), shapes, strict=True))


def all_to_all(sends: list[torch.Tensor], shapes: list[torch.Size], group: Any) -> list[torch.Tensor]:
    """Differentiable all-to-all over ``group``: ``sends[j]`` to rank ``j``; returns rank ``j``'s part for this rank,
    of shape ``shapes[j]``, for every ``j``."""
    return list(_AllToAll.apply(group, tuple(shapes), *sends))


def _lengths(t: int, group: Any) -> list[int]:
    """Every cp rank's chunk length (load-balanced and contiguous chunks of ``T`` positions differ by a column)."""
    mine = torch.tensor([t], dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(x) for x in out]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      group: Any) -> torch.Tensor:
    """Causal attention of this rank's chunk, ``q``, ``k``, ``v`` ``[B, H, t, D]`` with ``positions`` ``[B, t]`` (the
    columns' places in the full sequence), computed Ulysses' way over the cp ranks of ``group``: heads to positions,
    attention over every position for ``H / cp`` heads, positions back to heads. Returns ``[B, H, t, D]``."""
    n = dist.get_world_size(group)
    b, h, t, d = q.shape
    lengths = _lengths(t, group)
    per = h // n
    qkv = torch.stack((q, k, v))  # [3, B, H, t, D]
    # Heads to positions: head group j of this chunk to rank j; from rank i, head group `me` of its chunk.
    got = all_to_all([qkv[:, :, j * per:(j + 1) * per] for j in range(n)],
                     [torch.Size((3, b, per, lengths[i], d)) for i in range(n)], group)
    q_all, k_all, v_all = torch.cat(got, dim=3).unbind(0)  # [B, H/cp, L, D] each, L every position of the rows
    where = torch.cat(_plain_all_to_all([positions] * n, [torch.Size((b, lengths[i])) for i in range(n)], group),
                      dim=1)  # [B, L]
    mask = where.unsqueeze(1) <= where.unsqueeze(2)  # [B, L, L]: a query sees every key at or before its position
    att = (q_all @ k_all.transpose(-2, -1)) / math.sqrt(d)
    att = att.masked_fill(~mask.unsqueeze(1), float("-inf")).softmax(dim=-1)
    y = att @ v_all  # [B, H/cp, L, D]
    # Positions to heads: rank i's columns back to rank i; from rank j, head group j of this chunk.
    back = all_to_all(list(y.split(lengths, dim=2)), [torch.Size((b, per, t, d))] * n, group)
    return torch.cat(back, dim=1)


def _plain_all_to_all(sends: list[torch.Tensor], shapes: list[torch.Size], group: Any) -> list[torch.Tensor]:
    return list(_exchange([s.contiguous() for s in sends], tuple(shapes), group))


class UlyssesBlock(Block):
    """:class:`harness.model.Block` whose attention, under a cp group, is :func:`ulysses_attention`; without one
    (the single-device reference, a run without cp), the block itself, bit for bit."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        if self.cp_group is None:
            return super().forward(x, positions, segments)
        if positions is None:
            msg = ("this model shards the sequence over cp (Ulysses, its cp_plan) and got no position_ids: a cp rank "
                   "holds a chunk of each sequence, so pass its positions, model(mb.inputs, "
                   "position_ids=mb.positions)")
            raise RuntimeError(msg)
        qkv = self.qkv(self.ln1(x))
        b, t, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        h = self.n_heads
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in qkv.split(d, dim=2))
        y = ulysses_attention(q, k, v, positions, self.cp_group)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


def check_heads(cp: int, n_heads: int) -> None:
    """:class:`~harness.model.ModelError` (a ValueError) naming both where ``cp`` does not divide ``n_heads`` (Ulysses
    gives each cp rank ``n_heads / cp`` whole heads)."""
    if n_heads % cp:
        msg = (f"cp={cp} does not divide n_heads={n_heads}: Ulysses sequence parallelism gives each cp rank n_heads / "
               f"cp whole heads; run a cp that divides {n_heads} (--mesh dp=2,cp=2 for the built-in model's 2 heads), "
               "or the all-gather attention, --model harness.model:sequence_sharded")
        raise ModelError(msg)


def ulysses_cp_plan(model: nn.Module, cp_mesh: Any) -> None:
    """Make every :class:`UlyssesBlock` of ``model`` split its heads over ``cp_mesh`` (in place); ValueError where
    the cp size does not divide a block's heads (:func:`check_heads`)."""
    cp = int(cp_mesh.size())
    blocks = [m for m in model.modules() if isinstance(m, UlyssesBlock)]
    if not blocks:
        msg = (f"ulysses_cp_plan: {type(model).__name__} has no UlyssesBlock; build the model with "
               "harness.ulysses:ulysses (or harness.ulysses.ulysses_blocks(model))")
        raise ValueError(msg)
    for block in blocks:
        check_heads(cp, block.n_heads)
    group = cp_mesh.get_group()
    for block in blocks:
        block.cp_group = group


ulysses_cp_plan.check = lambda cp: check_heads(cp, Config().n_heads)  # type: ignore[attr-defined]
"""Called by the battery before any rank starts (``plan.check(cp)``, where a cp plan declares one): the factory's
model has the built-in configuration's heads."""


def ulysses_blocks(model: TinyCausalLM) -> TinyCausalLM:
    """``model`` with every block a :class:`UlyssesBlock` (the same parameters; the class alone changes), in place."""
    for block in model.blocks:
        block.__class__ = UlyssesBlock
    return model


def ulysses() -> TinyCausalLM:
    """The built-in model at the battery's size whose attention, under cp, is Ulysses' (``--model
    harness.ulysses:ulysses``): its 2 heads over cp=2, one head per rank. Without cp it is the built-in model, bit for
    bit. Its initial weights come from the seed the caller set (a ``--model`` factory is called right after
    ``torch.manual_seed``)."""
    return ulysses_blocks(build_model(Config(dropout=0.0), seed=torch.initial_seed()))


ulysses.cp_plan = ulysses_cp_plan  # type: ignore[attr-defined]


__all__ = ["UlyssesBlock", "all_to_all", "check_heads", "ulysses", "ulysses_attention", "ulysses_blocks",
           "ulysses_cp_plan"]
