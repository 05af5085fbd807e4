"""Training steps whose gradient is right in the model's dtype and whose logged loss is computed in float32, as
transformers' loss computes it (``logits.float()``), also for a float64 model: the float64 lane judges such a loss at
float32's tolerances when it can see the dtype (a float32 tensor returned), and says what it is when it cannot (a
Python float). One logs the mean of the ranks' means in float32: wrong by far more than float32's rounding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from user_recipes.logged import _step


def _float32_sums(window: Sequence[Any], model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The correct gradient; this rank's loss sum and token count, computed in float32 from the per-token losses."""
    per = torch.cat([x.flatten() for x in _step(model, window)]).float()
    kept = per[~per.isnan()]
    return kept.sum(), torch.tensor(float(kept.numel()))


class Float32LoggedLoss:
    """Logs the global token mean computed and all-reduced in float32, returned as the float32 tensor (``as_tensor``)
    or as a Python float."""

    name = "float32_logged_loss"

    def __init__(self, as_tensor: bool = True) -> None:
        self.as_tensor = as_tensor

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> torch.Tensor | float:
        s, n = _float32_sums(window, model)
        both = torch.stack([s, n])
        dist.all_reduce(both)
        logged = both[0] / both[1]
        return logged if self.as_tensor else float(logged)


class Float32LoggedMeanOfLocalMeans:
    """Logs the mean over ranks of each rank's own token mean, in float32, returned as the float32 tensor."""

    name = "float32_logged_mean_of_local_means"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> torch.Tensor:
        s, n = _float32_sums(window, model)
        mine = s / n if float(n) else torch.zeros((), dtype=torch.float32)
        dist.all_reduce(mine)
        return mine / dist.get_world_size()


as_tensor = Float32LoggedLoss()
as_float = Float32LoggedLoss(as_tensor=False)
mean_of_local_means = Float32LoggedMeanOfLocalMeans()
