"""A library-like module of the test recipes' own (no transformers needed): a ``set_seed`` that seeds the global
generators through their modules, as ``transformers.trainer_utils.set_seed`` does, and a ``Trainer`` whose
constructor calls it, as ``transformers.Trainer.__init__`` does."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn


def set_seed(seed: int) -> None:
    """Python's, numpy's and torch's global generators seeded, each through its module's attribute."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Holds the model; seeds the global generators on construction (``set_seed(seed)``)."""

    def __init__(self, model: nn.Module, seed: int = 42) -> None:
        self.model = model
        set_seed(seed)
