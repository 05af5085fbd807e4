"""The rank probe ``check-environment --dual`` launches (:func:`all_reduce_rank`): two gloo ranks meet and all-reduce.

In the package because the product runs it; the rank bodies that only the tests and the benchmarks launch (a DDP
step, bodies that raise, die, skip a collective or sleep) live in ``tests/support/probes.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_rank() -> int:
    """Every rank contributes ``rank + 1``; returns the sum (``W (W + 1) / 2`` on every rank)."""
    t = torch.tensor(dist.get_rank() + 1)
    dist.all_reduce(t)
    return int(t)


__all__ = ["all_reduce_rank"]
