"""The window plan: which sequence ids each rank reads in each microbatch of each step.

Seed 000's ``make_rank_batches`` generalised to W ranks. Rank r draws from the r-th of W equal-width bands
of sequence length over ``(0, max_len]``: for W=2 and ``max_len=128`` that is exactly the seed's 16-64 and 65-128.
The uneven split is deliberate: equal counts on every rank would hide the mean-of-means bias.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from harness.core.validate import positive_int
from harness.data.config import Config
from harness.data.corpus import Row

Plan = list[list[list[list[int]]]]
"""``plan[step][rank][microbatch]`` -> sequence ids."""


def length_bands(world_size: int, max_len: int) -> list[tuple[int, int]]:
    """Inclusive ``(low, high)`` length bounds of each rank's band; band r is ``(max_len*r/W, max_len*(r+1)/W]``."""
    positive_int("world_size", world_size)
    if not isinstance(max_len, int) or max_len < world_size:
        msg = f"max_len={max_len!r} must be an integer of at least world_size={world_size}"
        raise ValueError(msg)
    edges = [max_len * r // world_size for r in range(world_size + 1)]
    return [(edges[r] + 1, edges[r + 1]) for r in range(world_size)]


def rank_pools(rows: Sequence[Row], world_size: int, max_len: int) -> list[list[int]]:
    """Training ids of each rank's band, in corpus order."""
    bands = length_bands(world_size, max_len)
    return [[r.id for r in rows if r.split == "train" and lo <= len(r.tokens) <= hi] for lo, hi in bands]


def make_plan(rows: Sequence[Row], config: Config, world_size: int | None = None, steps: int | None = None) -> Plan:
    """``steps`` windows (default ``config.updates``) for ``world_size`` ranks (default ``config.world_size``).

    Within a window selection is without replacement (``random.sample``) and the bands are disjoint, so no id
    appears twice in a window; across windows an id may return, as in the seed.
    """
    world = config.world_size if world_size is None else world_size
    n_steps = config.updates if steps is None else steps
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
        msg = f"steps={n_steps!r} must be a non-negative integer"
        raise ValueError(msg)
    pools = rank_pools(rows, world, config.max_len)
    per_window = config.accumulation * config.batch_size_per_rank
    for rank, pool in enumerate(pools):
        if len(pool) < per_window:
            lo, hi = length_bands(world, config.max_len)[rank]
            msg = (
                f"world_size={world}: rank {rank}'s length band {lo}-{hi} holds {len(pool)} training sequences, "
                f"fewer than accumulation * batch_size_per_rank = {per_window}; raise train_size or lower world_size"
            )
            raise ValueError(msg)
    rng = random.Random(config.seed + 10)
    bs = config.batch_size_per_rank
    plan: Plan = []
    for _ in range(n_steps):
        selected = [rng.sample(pool, per_window) for pool in pools]
        plan.append([[ids[i : i + bs] for i in range(0, len(ids), bs)] for ids in selected])
    return plan
