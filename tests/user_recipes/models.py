"""Models written the way users write them, given to the battery with ``--model=user_recipes.models:<attr>``.

:class:`ConvLM` is not a transformer (a causal convolution over token embeddings), returns an output object with
``.logits`` as a Hugging Face model does, takes ``input_ids`` positionally or by keyword with an ``attention_mask``,
and has dropout (the battery must disable it, or the reference and the ranks would draw different masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

VOCAB = 32
"""The battery config's vocabulary size."""


@dataclass
class LMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class Config:
    """Shaped like a Hugging Face config: the dropout probability the forward pass reads at call time."""

    def __init__(self) -> None:
        self.hidden_dropout = 0.3


class ConvLM(nn.Module):
    """Embedding, dropout, two causal convolutions (each position sees itself and the ``kernel - 1`` before it),
    dropout again through ``config.hidden_dropout``, and a linear head."""

    def __init__(self, vocab: int = VOCAB, d: int = 24, kernel: int = 3) -> None:
        super().__init__()
        self.config = Config()
        self.kernel = kernel
        self.embed = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(0.5)
        self.conv1 = nn.Conv1d(d, d, kernel)
        self.conv2 = nn.Conv1d(d, d, kernel)
        self.head = nn.Linear(d, vocab)

    def _causal(self, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        return conv(nn.functional.pad(x, (self.kernel - 1, 0)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> LMOutput:
        x = self.drop(self.embed(input_ids))
        if attention_mask is not None:
            x = x * attention_mask.unsqueeze(-1).to(x.dtype)
        h = x.transpose(1, 2)
        h = h + nn.functional.gelu(self._causal(self.conv1, h))
        h = h + nn.functional.gelu(self._causal(self.conv2, h))
        h = nn.functional.dropout(h.transpose(1, 2), p=self.config.hidden_dropout, training=self.training)
        return LMOutput(self.head(h))


def make_model() -> ConvLM:
    """A zero-argument factory (``--model=user_recipes.models:make_model``)."""
    return ConvLM()


def returns_a_string() -> str:
    """Not a model: ``--model`` must refuse it before any rank starts."""
    return "not a model"


class TupleLM(nn.Module):
    """Returns ``(logits,)``, as ``return_dict=False`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        return (self.head(torch.cumsum(self.embed(input_ids), dim=1)),)


def draws_its_own_weights() -> ConvLM:
    """Initial weights from a private generator seeded by the process id: every process builds other weights, which
    the battery must report instead of comparing gradients taken at different weights."""
    import os

    model = ConvLM()
    g = torch.Generator().manual_seed(os.getpid())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def hides_a_parameter_from_ddp() -> ConvLM:
    """A model that tells DDP to leave ``conv2.weight`` alone (``_ddp_params_and_buffers_to_ignore``, as code that
    manages a parameter itself does): DDP never synchronizes its gradient, so each rank keeps its own. Every other
    tensor is right; the diagnosis must say the error is not a re-weighting and name that tensor alone."""
    model = ConvLM()
    model._ddp_params_and_buffers_to_ignore = ["conv2.weight"]  # type: ignore[assignment]
    return model


class HiddenStatesOnly(nn.Module):
    """Returns a dict of hidden states and no logits (a base model without its LM head): ``--model`` must refuse it
    before any rank starts, saying what the harness reads logits from."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"last_hidden_state": self.embed(input_ids)}


class UnusedHead(ConvLM):
    """A :class:`ConvLM` with a second head that forward never uses (left over from a previous experiment, as in
    real code): under DDP's defaults its gradient bucket never all-reduces and the next forward raises DDP's
    "Expected to have finished reduction in the prior iteration", naming ``find_unused_parameters=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.old_head = nn.Linear(24, VOCAB)


class SharedBlockCheckpointed(nn.Module):
    """One block applied twice, each application under reentrant activation checkpointing
    (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``): under DDP with ``find_unused_parameters=True``
    the block's parameters are marked ready twice in one backward, which DDP refuses, naming ``_set_static_graph()``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.block = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.embed(input_ids)
        for _ in range(2):
            h = h + checkpoint(self.block, h, use_reentrant=True)
        return self.head(torch.cumsum(h, dim=1))  # type: ignore[no-any-return]


def small_init_lm() -> ConvLM:
    """:class:`ConvLM` initialised the way a Hugging Face model from a config is (``initializer_range`` 0.02, zero
    biases): its logits start near zero, so every token's initial loss sits within a few 1e-3 of log V."""
    model = ConvLM()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return model
