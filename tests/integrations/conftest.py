"""The integrations lane: the library recipes against the real libraries (``bash scripts/integrations.sh``, or
``pytest -m integrations tests/integrations`` with the integrations extra installed).

The lane runs only when ``-m`` selects it: the default test command (``scripts/test.sh``) skips these tests with the
reason, also where the libraries happen to be installed, and a run that selects them without the libraries skips
each with the install to run."""

from __future__ import annotations

import pytest

LANE_HINT = "the integrations lane: run it with bash scripts/integrations.sh (pytest -m integrations)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integrations: the library recipes against the real transformers, accelerate "
                            "and torchtitan (needs the integrations extra: pip install .[integrations])")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "integrations" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason=LANE_HINT)
    for item in items:
        if item.get_closest_marker("integrations") is not None:
            item.add_marker(skip)
