"""Rows of the corpus into microbatches: padded inputs and aligned labels (see :mod:`harness.core.microbatch`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.data.corpus import Row


def collate(rows: Sequence[Row], device: torch.device | str = "cpu") -> Microbatch:
    """Pad ``rows`` into one microbatch; unsupervised targets (prompt, padding) get ``IGNORE_INDEX``."""
    if not rows:
        msg = "rows must hold at least one Row; a microbatch has at least one row"
        raise ValueError(msg)
    width = max(len(r.tokens) for r in rows) - 1
    inputs = torch.full((len(rows), width), PAD, dtype=torch.int64)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.int64)
    for b, r in enumerate(rows):
        n = len(r.tokens) - 1
        inputs[b, :n] = torch.tensor(r.tokens[:-1])
        targets = torch.tensor(r.tokens[1:])
        # Target t is tokens[t+1]; it lies in the prompt while t + 1 < prompt_len.
        first = max(r.prompt_len - 1, 0)
        labels[b, first:n] = targets[first:]
    return Microbatch(inputs.to(device), labels.to(device))
