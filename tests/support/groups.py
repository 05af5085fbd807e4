"""xdist groups shared by test files: tests that judge the same run are sent to one worker, where the runner's cache
makes them one launch (``bash scripts/test.sh`` runs ``--dist loadgroup``)."""

from __future__ import annotations


def control_group(name: str, world_size: int) -> str:
    """The group of every test that judges negative control ``name`` on its target at ``world_size``."""
    return f"control-{name}-world{world_size}"
