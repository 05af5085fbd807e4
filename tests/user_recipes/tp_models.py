"""A user's model under tensor parallelism (``--model=user_recipes.tp_models:<attr>`` with ``--mesh dp=2,tp=2``): a
token-wise MLP language model whose factory declares its plan beside it (``factory.tp_plan``), and the same model
from a factory that declares none.

The plan shards the MLP only (column- then row-parallel) and leaves the embedding and the head whole: under FSDP2 their
gradients then live on the dp mesh and the MLP's on the (dp, tp) mesh, the mix ``clip_grad_norm_`` cannot stack.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 32
"""The battery config's vocabulary size."""


class MlpLM(nn.Module):
    """Embedding, a GELU MLP on each position, a linear head: ``model(inputs) -> logits [B, T, V]``."""

    def __init__(self, vocab: int = VOCAB, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs)
        return self.head(x + self.down(nn.functional.gelu(self.up(x))))


def mlp_plan(model: nn.Module, tp_mesh: Any) -> None:
    """The MLP column- then row-parallel over ``tp_mesh``; the embedding and the head stay whole on every tp rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def make_tp_model() -> MlpLM:
    return MlpLM()


make_tp_model.tp_plan = mlp_plan  # type: ignore[attr-defined]


def make_model_without_plan() -> MlpLM:
    return MlpLM()
