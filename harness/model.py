"""A small causal language model: ``model(inputs) -> logits [B, T, V]`` in the parameters' dtype.

Small on purpose (18,944 parameters at the battery's size: the components every parity message counts) so that a
DDP step on CPU costs milliseconds and the suite measures the protocol, not the matrix multiplications.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.data.config import Config


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        # Explicit causal attention rather than scaled_dot_product_attention: the same kernel on every torch
        # version and device, and deterministic, which bit-exact resume relies on.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyCausalLM(nn.Module):
    """Token and position embeddings, ``n_layers`` pre-norm transformer blocks, a linear head."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        d_model: int = 32,
        n_layers: int = 1,
        n_heads: int = 2,
        dropout: float = 0.0,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.activation_checkpointing = activation_checkpointing
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dim() != 2 or inputs.shape[1] > self.max_len:
            msg = f"inputs must be [B, T] with T <= max_len={self.max_len}, got shape {tuple(inputs.shape)}"
            raise ValueError(msg)
        positions = torch.arange(inputs.shape[1], device=inputs.device)
        x = self.drop(self.tok(inputs) + self.pos(positions))
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                # Keep only each block's input; recompute its inside during backward.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln(x))


def build_model(
    config: Config, *, dropout: float | None = None, seed: int | None = None, activation_checkpointing: bool = False
) -> TinyCausalLM:
    """The model of ``config`` with initial weights drawn from ``seed`` (default ``config.seed``).

    The weights come from a private generator, so building a model never touches the global RNG state.
    """
    # nn.Linear and nn.Embedding draw their default initialization from the global RNG; fork it so that building a
    # model leaves the caller's RNG state exactly as it was (the weights are overwritten below anyway).
    with torch.random.fork_rng(devices=[]):
        model = TinyCausalLM(
            vocab_size=config.vocab_size,
            max_len=config.max_len,
            d_model=config.d_model,
            n_layers=config.n_layers,
            n_heads=config.n_heads,
            dropout=config.dropout if dropout is None else dropout,
            activation_checkpointing=activation_checkpointing,
        )
    g = torch.Generator().manual_seed(config.seed if seed is None else seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # layer-norm weights
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.to(config.dtype)


__all__ = ["TinyCausalLM", "build_model"]
