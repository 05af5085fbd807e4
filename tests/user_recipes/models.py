"""Models written the way users write them, given to the battery with ``--model=user_recipes.models:<attr>``.

:class:`GruLM` is not a transformer (a GRU over token embeddings), returns an output object with ``.logits`` as a
Hugging Face model does, takes ``input_ids`` positionally or by keyword with an ``attention_mask``, and has dropout
(the battery must disable it, or the reference and the ranks would draw different masks).
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


class GruLM(nn.Module):
    """Embedding, dropout, a one-layer GRU, dropout again through ``config.hidden_dropout`` read at call time, and a
    linear head."""

    class Config:
        hidden_dropout = 0.3

    def __init__(self, vocab: int = VOCAB, d: int = 24) -> None:
        super().__init__()
        self.config = GruLM.Config()
        self.config.hidden_dropout = 0.3  # an instance attribute, as a Hugging Face config holds it
        self.embed = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(0.5)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> LMOutput:
        x = self.drop(self.embed(input_ids))
        if attention_mask is not None:
            x = x * attention_mask.unsqueeze(-1).to(x.dtype)
        h, _ = self.gru(x)
        h = nn.functional.dropout(h, p=self.config.hidden_dropout, training=self.training)
        return LMOutput(self.head(h))


def make_gru() -> GruLM:
    """A zero-argument factory (``--model=user_recipes.models:make_gru``)."""
    return GruLM()


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
