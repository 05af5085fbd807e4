"""A model shaped like nanoGPT's ``GPT`` (``model.py`` of karpathy/nanoGPT, scaled down), as users bring it to the
battery, and one variant per way it stops on the battery's batches (``tests/unit/test_model_limits.py``).

nanoGPT's ``forward(idx, targets=None)`` asserts ``t <= block_size``, returns only the last position's logits
(``logits[:, [-1], :]``) when called without targets, and computes its loss with ``ignore_index=-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from user_recipes.models import VOCAB, LMOutput


@dataclass
class GPTConfig:
    block_size: int = 128
    vocab_size: int = VOCAB
    n_layer: int = 1
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.0
    ignore_index: int = -1
    """nanoGPT's loss ignores -1; the battery's unsupervised positions are -100."""
    all_positions: bool = False
    """nanoGPT returns only the last position's logits without targets; True: every position's."""
    assert_block: bool = True
    """nanoGPT asserts ``t <= block_size``; False: the position table raises its IndexError instead."""


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, as nanoGPT's."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's ``GPT``: token and learned position embeddings, blocks, a final LayerNorm, a head tied to the token
    embedding."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.block_size, config.n_embd),
            "drop": nn.Dropout(config.dropout),
            "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            "ln_f": nn.LayerNorm(config.n_embd),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        block = self.config.block_size
        if self.config.assert_block:
            assert t <= block, f"Cannot forward sequence of length {t}, block size is only {block}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.transformer.ln_f(x)

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.hidden(idx)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=self.config.ignore_index)
            return logits, loss
        if self.config.all_positions:
            return self.lm_head(x), None
        return self.lm_head(x[:, [-1], :]), None  # inference-time mini-optimization: the last position only


class HFStyleGPT(GPT):
    """The same network called the Hugging Face way: ``forward(input_ids, attention_mask=None, labels=None)`` with
    unshifted labels, shifting them in its own loss (ignoring ``config.ignore_index``)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,  # type: ignore[override]
                labels: torch.Tensor | None = None) -> LMOutput:
        logits = self.lm_head(self.hidden(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=self.config.ignore_index)
        return LMOutput(logits, loss)


class NarrowHead(GPT):
    """Every position's logits, from a head of half the battery's vocabulary (the embedding takes every id)."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(all_positions=True))
        self.lm_head = nn.Linear(self.config.n_embd, VOCAB // 2, bias=False)


class RaisesAnIndexError(GPT):
    """A forward that fails with an IndexError of its own, on every input: neither the vocabulary nor the row
    length."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        layers = list(self.transformer.h)
        return self.lm_head(layers[5](self.hidden(idx))), None


def nanogpt() -> GPT:
    """nanoGPT as it is: last-position logits without targets."""
    return GPT()


def nanogpt_all_positions() -> GPT:
    """Every position's logits without targets; its own loss still ignores -1."""
    return GPT(GPTConfig(all_positions=True))


def nanogpt_fixed() -> GPT:
    """Every position's logits, and its loss ignores the battery's -100: what the battery takes as it is."""
    return GPT(GPTConfig(all_positions=True, ignore_index=-100))


def small_vocab() -> GPT:
    """A vocabulary of 16 (the battery's ids go to 31): the embedding raises IndexError."""
    return GPT(GPTConfig(vocab_size=VOCAB // 2, all_positions=True, ignore_index=-100))


def short_block() -> GPT:
    """A block size of 4: nanoGPT's assertion on every battery row."""
    return GPT(GPTConfig(block_size=4, all_positions=True, ignore_index=-100))


def short_position_table() -> GPT:
    """A position table of 4 and no assertion: the same "index out of range in self" as a small vocabulary."""
    return GPT(GPTConfig(block_size=4, all_positions=True, ignore_index=-100, assert_block=False))


def half_block() -> GPT:
    """A block size of 64: the battery's rows of up to 64 positions run, longer ones are n/a."""
    return GPT(GPTConfig(block_size=64, all_positions=True, ignore_index=-100))


def short_block_hf() -> HFStyleGPT:
    """The hf-style network with a block size of 4."""
    return HFStyleGPT(GPTConfig(block_size=4, ignore_index=-100))


def hf_style_ignores_minus_one() -> HFStyleGPT:
    """The hf-style network whose own loss ignores -1."""
    return HFStyleGPT(GPTConfig())


def hf_style_fixed() -> HFStyleGPT:
    """The hf-style network whose own loss ignores -100."""
    return HFStyleGPT(GPTConfig(ignore_index=-100))


class LastPositionFlat(GPT):
    """The last position's logits as ``[B, V]`` (``logits[:, -1, :]``), as a generation-only forward returns them."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return self.lm_head(self.hidden(idx)[:, -1, :]), None
