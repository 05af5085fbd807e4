"""The ranks' records meeting on rank 0 and its verdict coming back, through the script's own process group: no file is
shared, so the ranks may sit on many nodes (:mod:`harness.audit.capture` at the end of the audited windows;
:meth:`harness.audit.watcher.Audit.verdict` in code)."""

from __future__ import annotations

from typing import Any


def group() -> tuple[int, int] | None:
    """(rank, world size) of the script's default process group; None when it has none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return None


def exchange(record: Any, verdict_of: Any) -> dict[str, Any]:
    """Every rank's record to rank 0, ``verdict_of(records)`` there, its verdict back to every rank."""
    import torch.distributed as dist

    found_group = group()
    if found_group is None or found_group[1] == 1:
        return verdict_of([record.to_plain()])
    rank, world = found_group
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(record.to_plain(), gathered, dst=0)
    found: list[Any] = [None]
    if rank == 0:
        assert gathered is not None
        found[0] = verdict_of(gathered)
    dist.broadcast_object_list(found, src=0)
    return found[0]


__all__ = ["exchange", "group"]
