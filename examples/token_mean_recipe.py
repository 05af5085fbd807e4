"""A recipe to copy into your own project: the global token mean under DDP, with gradient accumulation.

Check it (or your edited copy) with the battery:

    pytest --pyargs harness.battery --recipe=token_mean_recipe:recipe      # this file on PYTHONPATH
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


class TokenMeanRecipe:
    name = "example_token_mean"

    def backward_window(self, model: torch.nn.Module, window: Sequence) -> float:
        world = dist.get_world_size()
        # 1. Count this rank's supervised tokens over the whole window, and all-reduce the count *before* any
        #    backward: every rank needs the same denominator N. (Labels are IGNORE_INDEX at padding and prompts.)
        local = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in window)
        count = torch.tensor(local, dtype=torch.int64)  # on CPU for gloo; on the GPU for a pure NCCL group
        dist.all_reduce(count)
        total = int(count)
        if total == 0:
            # Every rank sees the same total, so every rank raises here together: nobody is left in a collective.
            raise ValueError("no supervised token in the global accumulation window")
        loss_sum = 0.0
        for i, mb in enumerate(window):
            # 2. Accumulate: forward *and* backward of all but the last microbatch inside no_sync().
            sync = i == len(window) - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                logits = model(mb.inputs)
                s = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
                # 3. Scale the *sum* by world_size / N: DDP averages gradients over ranks, and the factor W
                #    cancels that average.
                (s * (world / total)).backward()
            loss_sum += float(s.detach())
        # 4. The logged loss: the global token mean, the same on every rank.
        logged = torch.tensor(loss_sum, dtype=torch.float64)
        dist.all_reduce(logged)
        return float(logged) / total


recipe = TokenMeanRecipe()
