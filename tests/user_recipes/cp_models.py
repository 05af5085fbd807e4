"""Sequence-sharding models under context parallelism (``--model=user_recipes.cp_models:<attr>`` with ``--mesh
dp=2,cp=2``): the built-in model whose attention was written for contiguous chunks only, as a ring attention without
the load-balanced layout is (right under ``chunking="contiguous"``, wrong under ``"load_balanced"``, where a rank holds
chunks i and 2cp-1-i).

The correct one is ``harness.model:sequence_sharded``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from harness.data.config import Config
from harness.model import build_model, builtin_cp_plan


def _contiguous_only_plan(model: nn.Module, cp_mesh: Any) -> None:
    builtin_cp_plan(model, cp_mesh, assume_contiguous=True)


def contiguous_only() -> nn.Module:
    """The built-in model, its attention masking the gathered keys by the ranks' order (every earlier rank's keys
    visible, its own causally, later ranks' none) instead of by the positions."""
    return build_model(Config(dropout=0.0), seed=torch.initial_seed())


contiguous_only.cp_plan = _contiguous_only_plan  # type: ignore[attr-defined]


class NoPositions:
    """The correct count, but each chunk fed to the model without its positions (``model(mb.inputs)``), as a loop
    written for whole sequences does: a sequence-sharding model refuses it, naming ``position_ids``."""

    name = "no_positions"

    def backward_window(self, model: nn.Module, window: Any, mesh: Any = None) -> float | None:
        from harness.core.loss import loss_sum
        from harness.recipes.helpers import global_count, require_tokens, token_group, token_group_size

        total = require_tokens(global_count(sum(mb.supervised for mb in window), group=token_group(mesh)))
        size = token_group_size(mesh)
        for mb in window:
            (loss_sum(model(mb.inputs), mb.labels) * size / total).backward()
        return None
