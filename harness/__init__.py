"""Verification harness for distributed gradient semantics.

The public recipe contract (see docs/recipe-contract.md): a recipe's ``backward_window(model, window)`` must leave in
``.grad``, after DDP's synchronization, the gradient of the mean over every supervised token of every rank's window.

The public names are imported on first use (PEP 562), so that importing a submodule that needs no torch (the pytest
plugin, loaded in every pytest run of an environment that has the package) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.core.loss import global_count, global_token_loss, loss_sum, supervised_count
    from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
    from harness.data.config import Config, load_config
    from harness.recipes import Recipe

_WHERE = {
    "IGNORE_INDEX": "harness.core.microbatch",
    "PAD": "harness.core.microbatch",
    "Microbatch": "harness.core.microbatch",
    "Config": "harness.data.config",
    "load_config": "harness.data.config",
    "Recipe": "harness.recipes",
    "global_count": "harness.core.loss",
    "global_token_loss": "harness.core.loss",
    "loss_sum": "harness.core.loss",
    "supervised_count": "harness.core.loss",
}

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


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        msg = f"module 'harness' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
