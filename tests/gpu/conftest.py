"""Fixtures shared by the two CUDA lanes: battery runs on CUDA ranks, and the environment of bit-equality runs.

Nothing here touches CUDA at import or collection: the lanes' skips (``harness.testing.skips``) decide, in the parent,
whether a test runs at all (or fails, where ``HARNESS_REQUIRE_GPUS`` requires its lane), and every CUDA kernel of the
battery runs inside launched ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.battery import scenarios
from harness.battery.launch import runner
from harness.battery.launch.run import Run

DEADLINE = 90.0
"""Seconds one battery run on CUDA ranks may take: each rank creates its own CUDA context (seconds, not the 0.1 s of
a warm CPU rank), and a hang is still reported well inside the script's own time limit."""

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""Set in every rank whose results are compared bit for bit. cuBLAS picks reduction strategies per call unless its
workspace is fixed; ``:4096:8`` is the setting PyTorch's reproducibility notes require for deterministic cuBLAS on
CUDA >= 10.2. It must be in the environment before the rank's first cuBLAS call, hence ``launch(..., env=...)``."""

BatteryRun = Callable[[str, str, str], Run]


def battery_run(recipe: str, scenario: str, backend: str, *, device: str = "cuda", world_size: int = 2) -> Run:
    """The battery's ``scenario`` for ``recipe`` on ``world_size`` ranks of ``device`` over ``backend``, in fp32.

    ``runner.run`` caches by recipe, scenario, world size, precision and device but not by backend, so the lanes
    call ``run_windows`` (uncached) and keep their own cache, keyed by backend as well.
    """
    windows = scenarios.build(scenario, world_size)
    return runner.run_windows(recipe, windows, "fp32", scenario=scenario, device=device, backend=backend,
                              deadline=DEADLINE)


@pytest.fixture(scope="session")
def cuda_battery() -> BatteryRun:
    """``cuda_battery(recipe, scenario, backend)``: a two-rank CUDA run, launched once per session and arguments."""
    cache: dict[tuple[str, str, str], Run] = {}

    def get(recipe: str, scenario: str, backend: str) -> Run:
        key = (recipe, scenario, backend)
        if key not in cache:
            cache[key] = battery_run(recipe, scenario, backend)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def deterministic_env() -> dict[str, str]:
    """Environment for ranks whose results are compared bit for bit (see ``DETERMINISTIC_ENV``)."""
    return dict(DETERMINISTIC_ENV)
