"""Correct recipes for a declared objective on a device mesh with cp, where each cp rank holds a chunk of every
sequence's positions: what such an objective's quantities are reduced over differs from the token mean's.
``per_shard_sequence_mean`` (:mod:`harness.recipes.controls.context_parallel`) is the sequence mean's wrong twin.

    python -m harness battery --objective sequence_mean --mesh dp=2,cp=2 \\
        --recipe harness.recipes.mesh_objectives:mesh_sequence_mean
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from harness.core.loss import count_device, global_count
from harness.core.microbatch import IGNORE_INDEX
from harness.recipes.correct import global_sum
from harness.recipes.helpers import data_group, require_tokens, sync_context, token_group, token_group_size
from harness.recipes.objectives import Batch, SequenceMean, _labels, forward


class MeshSequenceMean(SequenceMean):
    """The sequence mean on a device mesh with cp: each cp rank holds a chunk of every sequence's positions, so each
    row's supervised count is all-reduced over the cp group (``mesh["cp"]``) before the first backward, and the
    chunk's tokens are divided by that whole count; the sequences with a supervised token are counted once, over the
    data-parallel group (every cp rank of a data coordinate holds the same rows), and each rank's term is scaled by
    the token group's size over that count, which the gradients' average over the token group undoes. Without cp it
    is :class:`SequenceMean`. Rows are the sequences (the harness and ``hf`` formats)."""

    name = "mesh_sequence_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Batch], mesh: Any = None) -> float | None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if "cp" not in names or mesh["cp"].size() == 1:
            return super().backward_window(model, window)
        cp, size = mesh["cp"].get_group(), token_group_size(mesh)
        require_tokens(global_count(sum(int((_labels(mb) != IGNORE_INDEX).sum()) for mb in window),
                                    group=token_group(mesh)))
        counts = []
        for mb in window:  # each row's count over its chunks, before any backward
            c = (_labels(mb) != IGNORE_INDEX).sum(dim=1).to(device=count_device())
            dist.all_reduce(c, group=cp)
            counts.append(c.cpu())
        sequences = global_count(sum(int((c > 0).sum()) for c in counts), group=data_group(mesh))
        local = 0.0
        for i, (mb, c) in enumerate(zip(window, counts)):
            with sync_context(model, i, len(window)):
                _, ce, mask, _ = forward(model, mb)
                term = ((ce * mask).sum(dim=1) / c.to(ce.device, ce.dtype).clamp(min=1)).sum()
                (term * (size / sequences)).backward()
            local += float(term.detach()) / sequences
        return global_sum(local, token_group(mesh))


mesh_sequence_mean = MeshSequenceMean()

__all__ = ["MeshSequenceMean", "mesh_sequence_mean"]
