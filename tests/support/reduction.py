"""The reduction contract (seed 001): the loss scale depends on how the communication hook reduces.

Rank r backpropagates ``c * S_r`` (``S_r`` its loss sum); the hook combines the ranks' gradients. The objective is
``(sum_r S_r) / N`` with ``N`` the global supervised count. Derive ``c`` from the hook, never copy it:

* **averaging hook** (DDP's default, the harness's ``reduction="mean"``): the result is ``(1/W) sum_r c g_r``, so
  ``c = W / N`` (:func:`harness.core.loss.global_token_loss`);
* **summing hook** (``reduction="sum"``): the result is ``sum_r c g_r``, so ``c = 1 / N``. The correct recipe for the
  averaging hook is W times too large under it; at W = 1 the two hooks, and the two scales, coincide.

The harness's one comm hook (``harness.distributed.hooks``, which also counts synchronizations; DDP takes a single
hook) does either: ``run_windows(..., reduction="sum")`` selects the sum. Test code, not the product's
(``tests/distributed/test_reduction_contract.py``): ranks import it as ``support.reduction`` (``tests/`` on
``sys.path``), and its recipe is named ``support.reduction:summing_hook_token_mean``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from harness.core.loss import check_global_count
from harness.core.microbatch import Microbatch
from harness.core.validate import positive_int
from harness.distributed.hooks import REDUCTIONS
from harness.recipes import accumulate, window_count


def loss_scale(reduction: str, global_count: int, world_size: int) -> float:
    """The factor ``c`` each rank multiplies its loss sum by, so that the hook's result is the global token mean."""
    if reduction not in REDUCTIONS:
        msg = f"reduction={reduction!r} must be one of {REDUCTIONS} (how the comm hook combines rank gradients)"
        raise ValueError(msg)
    positive_int("world_size", world_size, "the number of ranks the hook combines")
    check_global_count(global_count)
    # mean: the hook divides by W, so multiply by W first; sum: the hook adds, nothing to cancel.
    return (world_size if reduction == "mean" else 1) / global_count


class SummingHookTokenMean:
    """The global token mean derived for a *summing* comm hook: each rank backpropagates ``S_r / N``.

    Passes parity under ``run_windows(..., reduction="sum")``; under DDP's averaging it is W times too small, which
    is why the reduction is part of the recipe's contract and not a detail of the launcher.
    """

    name = "summing_hook_token_mean"
    reduction = "sum"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        scale = loss_scale(self.reduction, window_count(window), world)
        accumulate(model, window, lambda s: s * scale)
        return None


summing_hook_token_mean = SummingHookTokenMean()

__all__ = ["SummingHookTokenMean", "loss_scale", "summing_hook_token_mean"]
