"""The ``DistributedSampler`` epoch mode, beside seed 000's window plan: which example IDs each rank reads per epoch,
and an audit of every epoch that reports (never hides) what the sharding did to the dataset's exposure.

Seed 004's facts, all reproduced here and checked by ``tests/unit/test_sampling.py``:

* ``DistributedSampler`` gives rank r every W-th index of one permutation, so shards are disjoint by construction...
* ...except when ``len(dataset)`` is not a multiple of W: it then *pads* by repeating the first indices, so some
  examples are seen twice in an epoch (10 items on 3 ranks: 0 and 1 twice). ``drop_last=True`` instead drops the tail
  (9 is never seen). Either may be acceptable, but both change the exposure, so the audit reports them.
* The shuffle is seeded by ``seed + epoch``, and the epoch is only what ``set_epoch`` was told: forgetting it replays
  the same order every epoch.

The sampler is built with explicit ``num_replicas`` and ``rank``, so no process group is needed: the plan for every
rank is computed in one process, exactly as each rank would compute its own. It draws from a private generator and
never touches the global RNG state. Test code, not the product's: no harness module uses it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from torch.utils.data import Dataset, DistributedSampler

from harness.core.validate import positive_int


@dataclass(frozen=True)
class EpochAudit:
    """What one epoch's shards did to the dataset: every field is a finding, none is an error by itself."""

    dataset_size: int
    per_rank: tuple[int, ...]
    """Examples each rank reads (equal on every rank: the sampler pads or drops to make it so)."""
    duplicates: dict[int, int]
    """Example ID -> times read this epoch, for every ID read more than once (sampler padding)."""
    omissions: tuple[int, ...]
    """IDs of the dataset never read this epoch (``drop_last``, or a broken sharding)."""
    overlaps: tuple[int, ...]
    """IDs read by more than one rank."""

    @property
    def disjoint(self) -> bool:
        """No example is read by two ranks."""
        return not self.overlaps

    @property
    def covers(self) -> bool:
        """Every example of the dataset is read at least once."""
        return not self.omissions

    @property
    def exact(self) -> bool:
        """Every example read exactly once: the epoch's exposure is the dataset, no more and no less."""
        return self.covers and not self.duplicates

    def summary(self) -> str:
        reads = sum(self.per_rank)
        return (
            f"{self.dataset_size} examples, {reads} reads over {len(self.per_rank)} ranks {list(self.per_rank)}; "
            f"duplicates {dict(sorted(self.duplicates.items()))}, omissions {list(self.omissions)}, "
            f"read by several ranks {list(self.overlaps)}"
        )


def audit(shards: Sequence[Sequence[int]], dataset_size: int) -> EpochAudit:
    """Audit one epoch: ``shards[rank]`` lists the example IDs (``0 .. dataset_size - 1``) that rank reads."""
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 0:
        msg = f"dataset_size={dataset_size!r} must be a non-negative integer (the number of examples)"
        raise ValueError(msg)
    if not shards:
        msg = "shards must hold one list of example IDs per rank (at least one rank)"
        raise ValueError(msg)
    reads: Counter[int] = Counter()
    ranks_of: dict[int, set[int]] = {}
    for rank, shard in enumerate(shards):
        for i in shard:
            if not 0 <= i < dataset_size:
                msg = f"shards[{rank}] holds example ID {i!r}, outside 0 .. {dataset_size - 1}; pass the dataset's size"
                raise ValueError(msg)
            reads[i] += 1
            ranks_of.setdefault(i, set()).add(rank)
    return EpochAudit(
        dataset_size=dataset_size,
        per_rank=tuple(len(s) for s in shards),
        duplicates={i: n for i, n in sorted(reads.items()) if n > 1},
        omissions=tuple(i for i in range(dataset_size) if i not in reads),
        overlaps=tuple(sorted(i for i, r in ranks_of.items() if len(r) > 1)),
    )


def epoch_shards(
    dataset_size: int,
    world_size: int,
    epoch: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    set_epoch: bool = True,
) -> list[list[int]]:
    """Each rank's indices for ``epoch``, as ``DistributedSampler`` on that rank yields them.

    ``set_epoch=False`` reproduces the common mistake of never calling ``sampler.set_epoch(epoch)``: the sampler
    then stays at epoch 0 and replays the same order every epoch.
    """
    _check(dataset_size, world_size, epoch)
    shards = []
    for rank in range(world_size):
        sampler = _sampler(dataset_size, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        if set_epoch:
            sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def rank_seeded_shards(dataset_size: int, world_size: int, epoch: int, *, seed: int = 0) -> list[list[int]]:
    """NEGATIVE CONTROL: each rank seeds its sampler with ``seed + rank`` (a real mistake: "a different seed per
    rank, for variety"). Every rank then shards a *different* permutation, so ranks read overlapping examples and
    some examples nobody reads; :func:`audit` must report both."""
    _check(dataset_size, world_size, epoch)
    shards = []
    for rank in range(world_size):
        sampler = _sampler(dataset_size, world_size, rank, shuffle=True, seed=seed + rank, drop_last=False)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


@dataclass(frozen=True)
class Epoch:
    """One epoch of the epoch mode: each rank's example IDs, and the audit of them."""

    epoch: int
    ids: list[list[int]]
    """``ids[rank]``: the example IDs (``Row.id`` when built from rows) that rank reads, in order."""
    audit: EpochAudit


def epoch_plan(
    example_ids: Sequence[int],
    world_size: int,
    epochs: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    set_epoch: bool = True,
) -> list[Epoch]:
    """The epoch mode over a dataset of ``example_ids`` (e.g. ``[r.id for r in split_rows(rows, "train")]``):
    per epoch, each rank's example IDs and the epoch's audit (in terms of those IDs)."""
    positive_int("epochs", epochs)
    ids = list(example_ids)
    if len(set(ids)) != len(ids):
        msg = "example_ids must be unique (an ID that appears twice would hide a sampler duplicate)"
        raise ValueError(msg)
    plan = []
    for e in range(epochs):
        shards = epoch_shards(len(ids), world_size, e, seed=seed, shuffle=shuffle, drop_last=drop_last,
                              set_epoch=set_epoch)
        report = audit(shards, len(ids))
        # Report in the dataset's own IDs, so a duplicate names the example a person can look up.
        named = EpochAudit(
            dataset_size=report.dataset_size,
            per_rank=report.per_rank,
            duplicates={ids[i]: n for i, n in report.duplicates.items()},
            omissions=tuple(ids[i] for i in report.omissions),
            overlaps=tuple(ids[i] for i in report.overlaps),
        )
        plan.append(Epoch(e, [[ids[i] for i in s] for s in shards], named))
    return plan


def _sampler(n: int, world_size: int, rank: int, **options: Any) -> DistributedSampler[int]:
    # The sampler only asks the dataset for its length; a range of n indices is dataset enough.
    return DistributedSampler(cast("Dataset[int]", range(n)), num_replicas=world_size, rank=rank, **options)


def _check(dataset_size: object, world_size: object, epoch: object) -> None:
    positive_int("dataset_size", dataset_size, "the number of examples")
    positive_int("world_size", world_size, "the number of ranks")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        msg = f"epoch={epoch!r} must be a non-negative integer"
        raise ValueError(msg)


__all__ = ["Epoch", "EpochAudit", "audit", "epoch_plan", "epoch_shards", "rank_seeded_shards"]
