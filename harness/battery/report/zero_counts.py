"""Which battery cases give some rank, microbatch or cp chunk no supervised token: where a recipe divides by a count of
its own (a rank's, a microbatch's, a group's, a shard's), that count is zero there, and a recipe that guards the zero
by skipping its backward (or raises) leaves its peers in a collective. A run that fails that way on such a case
(a desync, a crash) is then one more view of the local count the other cases read as a weighting
(:mod:`harness.battery.report.recipe_cause`)."""

from __future__ import annotations

import functools

from harness.battery import mesh_scenarios, scenarios
from harness.core.mesh import Mesh
from harness.data.context_parallel import supervise_chunk

LOCAL_COUNTS = ("mean_of_local_means", "per_microbatch_mean", "count_group", "subgroup_count", "per_rank_normalizer",
                "per_shard_sequence_mean", "block_scaled")
"""The readings of a count local to a rank, a microbatch, a group or a shard: each is zero where that part holds no
supervised token."""


@functools.lru_cache(maxsize=256)
def local_count_is_zero(scenario: str, world_size: int, mesh: str | None = None, chunking: str = "contiguous") -> bool:
    """Whether some window of ``scenario`` (at ``world_size``, or over ``mesh``) leaves a rank, a microbatch or a cp
    chunk of a microbatch without a supervised token (False for a scenario this cannot build: the drawn layouts)."""
    try:
        layout = Mesh.parse(mesh) if mesh else None
        windows = (mesh_scenarios.build(scenario, layout, chunking) if layout is not None
                   else scenarios.build(scenario, world_size))
    except (KeyError, ValueError):
        return False
    cp = layout.size("cp") if layout is not None else 1
    for window in windows:
        for rank in window:
            if sum(mb.supervised for mb in rank) == 0:
                return True
            for mb in rank:
                if mb.supervised == 0 or any(supervise_chunk(mb, c, cp, chunking).supervised == 0
                                             for c in range(cp) if cp > 1):
                    return True
    return False


__all__ = ["LOCAL_COUNTS", "local_count_is_zero"]
