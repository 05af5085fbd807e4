"""Models whose own backward code the battery must check (``--model=user_recipes.backward_models:<attr>``): custom
``torch.autograd.Function`` kernels with a wrong backward and with a right one, parameters whose gradient a reentrant
activation checkpoint drops, and a right model with a LayerNorm and a head the loss never uses.

Every model takes ``model(input_ids)`` (and ``attention_mask=`` for the hf format) and returns logits ``[B, T, V]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 32
"""The battery config's vocabulary size."""


class _AttentionFn(torch.autograd.Function):
    """Causal softmax attention with a hand-written backward, as a fused kernel has. ``right=False`` drops the
    softmax Jacobian's ``- p * sum(p * dp)`` term: the mistake of a backward written as if softmax were
    elementwise."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, right: bool) -> torch.Tensor:
        t = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        p = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        ctx.save_for_backward(q, k, v, p)
        ctx.right = right
        return p @ v

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, p = ctx.saved_tensors
        dv = p.transpose(-2, -1) @ grad
        dp = grad @ v.transpose(-2, -1)
        ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True)) if ctx.right else p * dp
        ds = ds / math.sqrt(q.shape[-1])
        return ds @ k, ds.transpose(-2, -1) @ q, dv, None


class FusedAttention(nn.Module):
    """One head of causal attention through :class:`_AttentionFn`."""

    def __init__(self, d: int, right: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.right = right

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return _AttentionFn.apply(q, k, v, self.right)  # type: ignore[no-any-return]


class AttentionLM(nn.Module):
    """Embedding, a LayerNorm, one fused attention block, a linear head."""

    def __init__(self, right: bool = False, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.norm = nn.LayerNorm(d)
        self.attn = FusedAttention(d, right)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        return self.head(x + self.attn(self.norm(x)))  # type: ignore[no-any-return]


def wrong_attention() -> AttentionLM:
    """A custom attention whose backward drops the softmax Jacobian's second term."""
    return AttentionLM(right=False)


def right_attention() -> AttentionLM:
    """The same custom attention with its right backward: the check must pass it."""
    return AttentionLM(right=True)


class _SoftcapFn(torch.autograd.Function):
    """Fused logit soft-capping, ``cap * tanh(logits / cap)`` (Gemma's final-logit softcapping), whose backward passes
    the incoming gradient through unchanged: it forgets the ``1 - tanh^2`` factor, which is close to 1 only for
    logits far below the cap."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, cap: float) -> torch.Tensor:
        return cap * torch.tanh(logits / cap)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class SoftcapLM(nn.Module):
    """Logits soft-capped at 2 through :class:`_SoftcapFn`, applied in the model's own ``forward`` between its
    children rather than in a module of its own."""

    CAP = 2.0

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        x = torch.tanh(self.mix(torch.cumsum(x, dim=1) / steps))
        return _SoftcapFn.apply(self.head(x), self.CAP)  # type: ignore[no-any-return]


class NormWithUnusedHead(nn.Module):
    """A right model: embedding, a causal running mean, a LayerNorm, an LM head, and a value head the language-model
    loss never calls."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.mix = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)
        self.value_head = nn.Linear(d, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        x = torch.nn.functional.gelu(self.mix(torch.cumsum(x, dim=1) / steps))
        return self.head(self.norm(x))  # type: ignore[no-any-return]


class Block(nn.Module):
    """A pre-norm causal running-mean block with an MLP: 6 parameter tensors."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).view(1, -1, 1)
        return x + self.down(torch.nn.functional.gelu(self.up(torch.cumsum(h, dim=1) / steps)))


class FrozenEmbeddingCheckpointed(nn.Module):
    """Frozen token embeddings (``requires_grad=False``, as when only adapters or the blocks train) and three blocks
    under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``: the first block's input needs no gradient,
    so the reentrant checkpoint's output needs none either and every block's 18 parameters (3 x 6) get no gradient,
    though the forward uses them. (Hugging Face's ``enable_input_require_grads()`` or ``use_reentrant=False`` is the
    fix.)"""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return self.head(h)  # type: ignore[no-any-return]


class FrozenEmbeddingCheckpointedRight(FrozenEmbeddingCheckpointed):
    """The same with ``use_reentrant=False``: every block gets its gradient (the control)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.head(h)  # type: ignore[no-any-return]


class ReluLM(NormWithUnusedHead):
    """A right model with ReLUs (non-differentiable at zero) and no unused head: a step across a kink must not read
    as a wrong backward."""

    def __init__(self, d: int = 16) -> None:
        super().__init__(d)
        del self.value_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        return self.head(self.norm(torch.relu(self.mix(torch.relu(torch.cumsum(x, dim=1) / steps)))))


class Float32OnlyLM(NormWithUnusedHead):
    """Keeps a float32 mixing table as a plain attribute (not a parameter or buffer, as a precomputed rotary table
    sometimes is), so ``.to(torch.float64)`` leaves it float32 and a float64 forward raises in the matmul: the
    backward is checked in float32, and the note says so."""

    def __init__(self, d: int = 16) -> None:
        super().__init__(d)
        del self.value_head
        self.table = torch.eye(d) * 0.5

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) @ self.table
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        return self.head(self.norm(torch.tanh(self.mix(torch.cumsum(x, dim=1) / steps))))  # type: ignore[no-any-return]


class DetachedBranchLM(NormWithUnusedHead):
    """Adds a gate branch whose output is detached before it joins the residual: the forward uses ``gate``'s
    parameters (the loss changes along them) and no gradient reaches them."""

    def __init__(self, d: int = 16) -> None:
        super().__init__(d)
        del self.value_head
        self.gate = nn.Linear(d, d)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        x = torch.tanh(self.mix(torch.cumsum(x, dim=1) / steps))
        x = x + torch.sigmoid(self.gate(x)).detach()
        return self.head(self.norm(x))  # type: ignore[no-any-return]
