"""DDP's own errors reach a verdict with the lines that name their cause and their remedy.

The ranks run a user's model under DDP through the launcher directly (not the battery, whose DDP options may change):
a parameter unused in forward, and a block applied twice under reentrant checkpointing. The verdict the battery
builds from such a failed run keeps the failing rank's exception type and the lines DDP wrote for the user.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

from harness.battery.judge import checks
from harness.battery.launch.runner import Run
from harness.distributed.launcher import LaunchError, launch

HERE = Path(__file__).parent


@pytest.fixture
def bodies(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``launcher_bodies``, imported by plain name from this folder (each rank inherits the caller's sys.path)."""
    monkeypatch.syspath_prepend(str(HERE))
    return importlib.import_module("launcher_bodies")


def _parity_of_failed_launch(fn: object, *args: object) -> str:
    with pytest.raises(LaunchError) as info:
        launch(fn, 2, *args, deadline=30)  # type: ignore[arg-type]
    assert "raised" == info.value.kind, str(info.value)
    run = Run(recipe="user_recipes.variants:recipe", scenario="custom", world_size=2, precision="fp32", windows=[],
              failure=info.value)
    verdict = checks.parity(run)
    assert ("fail", "crash") == (verdict.status, verdict.cause), verdict.message
    return verdict.message


def test_an_unused_parameter_verdict_names_find_unused_parameters_and_the_parameter_indices(
    bodies: ModuleType,
) -> None:
    """Two DDP steps of a model with a head unused in forward: the verdict keeps DDP's remedy and culprit lines."""
    message = _parity_of_failed_launch(bodies.ddp_steps, "UnusedHead", 2)
    assert "RuntimeError: Expected to have finished reduction in the prior iteration" in message
    assert "`find_unused_parameters=True`" in message
    assert "Parameter indices which did not receive grad for rank" in message
    assert "TORCH_DISTRIBUTED_DEBUG" in message


def test_reentrant_checkpointing_of_a_shared_block_keeps_the_static_graph_remedy(bodies: ModuleType) -> None:
    """A block checkpointed twice (use_reentrant=True): the verdict keeps _set_static_graph() and the parameter."""
    message = _parity_of_failed_launch(bodies.ddp_steps, "SharedBlockCheckpointed", 1, True)
    assert "RuntimeError: Expected to mark a variable ready only once" in message
    assert "_set_static_graph()" in message
    assert "with name block." in message and "marked as ready twice" in message
