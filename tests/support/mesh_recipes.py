"""Recipes for a device mesh written as users of one write them (test-only), each taking the ``mesh`` the harness
passes: under HSDP, the fix of a clipping norm summed over the replicas (the mesh's count controls are
``harness.recipes.controls.context_parallel``)."""

from __future__ import annotations

from typing import Any

from harness.recipes.controls.hsdp import NormOverReplicas
from harness.recipes.helpers import shard_group


class NormOverShardGroup(NormOverReplicas):
    """VeOmni's fix (PR #862) of ``harness.recipes:norm_over_replicas``: the same hand-written norm, its squared shard
    norms summed over the shard group only (each replica holds every shard once), so it is the global norm."""

    name = "norm_over_shard_group"

    def norm_group(self, mesh: Any) -> Any:
        return shard_group(mesh)
