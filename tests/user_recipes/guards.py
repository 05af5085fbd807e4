"""Rank bodies that guard a window with the recipe helpers, as a user's training step does (launched by
``tests/distributed/test_user_models.py``)."""

from __future__ import annotations

import torch.distributed as dist

from harness.recipes import global_count, require_tokens


def guarded_window(local_counts: list[int]) -> int:
    """Rank r holds ``local_counts[r]`` supervised tokens; the guard runs on the global count, so a window empty on
    every rank raises ValueError on every rank, and a window empty on some ranks only raises nowhere."""
    return require_tokens(global_count(local_counts[dist.get_rank()]))
