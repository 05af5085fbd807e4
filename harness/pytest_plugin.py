"""The harness's pytest plugin: markers, options and fixtures shared by the repository's tests and the shipped battery.

Loaded by the repository's ``conftest.py`` from a checkout, or by the ``pytest11`` entry point once installed.
"""

from __future__ import annotations

import pytest

MARKERS = {
    "recipe": "the recipe battery: gradient-semantics checks of a recipe (--recipe=pkg.module:attr picks it)",
    "gpu": "needs one CUDA device",
    "gpu2": "needs two CUDA devices and NCCL (one rank per device)",
    "slow": "takes more than a few seconds; CI runs it, `-m 'not slow'` leaves it out locally",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
