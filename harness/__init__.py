"""Verification harness for distributed gradient semantics.

The public recipe contract (see README): a recipe's ``backward_window(model, window)`` must leave in ``.grad``, after
DDP's synchronization, the gradient of the mean over every supervised token of every rank's window.
"""

from __future__ import annotations

from harness.core.loss import global_count, global_token_loss, loss_sum, supervised_count
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.data.config import Config, load_config
from harness.recipes import Recipe

__all__ = [
    "IGNORE_INDEX",
    "PAD",
    "Config",
    "Microbatch",
    "Recipe",
    "global_count",
    "global_token_loss",
    "load_config",
    "loss_sum",
    "supervised_count",
]
