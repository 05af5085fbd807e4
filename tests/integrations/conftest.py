"""The integrations lane: the library recipes against the real libraries (``bash scripts/integrations.sh``, or
``pytest -m integrations tests/integrations`` with the integrations extra installed).

The lane runs only when ``-m`` selects it: the default test command (``scripts/test.sh``) skips these tests with the
reason, also where the libraries happen to be installed, and a run that selects them without the libraries skips
each with the install to run.

The lane records the versions it ran: pytest's header prints them (``integrations lane versions: torch ...,
transformers ..., accelerate ..., torchtitan ...``), and each is a test-suite property of the JUnit report
(``<property name="transformers" value="5.25.0"/>``; ``scripts/integrations.sh`` writes
``outputs/integrations-junit.xml``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.recipes.libraries import TESTED_WITH, installed_version

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


def lane_versions() -> dict[str, str]:
    """The installed version of each library the lane tests (``"not installed"`` where absent)."""
    return {name: installed_version(name) or "not installed" for name in TESTED_WITH}


def pytest_report_header(config: pytest.Config) -> str:
    ran = ", ".join(f"{name} {version}" for name, version in lane_versions().items())
    tested = ", ".join(f"{name} {version}" for name, version in TESTED_WITH.items())
    return f"integrations lane versions: {ran} (verdicts declared for {tested})"


@pytest.fixture(scope="session", autouse=True)
def _record_lane_versions(record_testsuite_property: Callable[[str, object], None]) -> None:
    """The versions as JUnit test-suite properties, so a CI report says what the lane ran against."""
    for name, version in lane_versions().items():
        record_testsuite_property(name, version)
