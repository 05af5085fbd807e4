"""The harness's DDP communication hook: it counts gradient synchronizations and reduces like DDP's default.

A DDP model takes exactly one comm hook (a second ``register_comm_hook`` raises), so counting and reducing live in
one hook. Counting *windows that synchronized* is subtle: DDP all-reduces once per bucket and rebuilds its buckets
after the first iteration (1 call in iteration 0, 2 afterwards were seen on the battery's model), so the hook counts the
backward passes in which it sees ``bucket.is_last()``: one per backward that synchronizes, whatever the bucketing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

REDUCTIONS = ("mean", "sum")


class SyncCounter:
    """State of :func:`counting_hook`: how many backward passes synchronized, and how buckets are reduced."""

    def __init__(self, reduction: str = "mean", group: object = None) -> None:
        if reduction not in REDUCTIONS:
            msg = f"reduction={reduction!r} must be one of {REDUCTIONS} ('mean' is DDP's default)"
            raise ValueError(msg)
        self.reduction = reduction
        self.syncs = 0
        self.group = group
        """The process group DDP reduces over (None: every rank)."""


# No annotations on the hook: DDP inspects them and rejects anything but the real GradBucket/Future classes, which
# postponed (string) annotations are not.
def counting_hook(state, bucket):
    tensor = bucket.buffer()
    if state.reduction == "mean":
        # DDP's default allreduce_hook divides before reducing; so do we, to reproduce its numbers.
        tensor.div_(dist.get_world_size(state.group))
    if bucket.is_last():
        state.syncs += 1
    fut = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def attach(model: torch.nn.Module, reduction: str = "mean", group: object = None) -> SyncCounter:
    """Register the counting hook on a DDP ``model`` reducing over ``group`` (None: every rank) and return its
    counter."""
    counter = SyncCounter(reduction, group)
    model.register_comm_hook(counter, counting_hook)  # type: ignore[operator]
    return counter
