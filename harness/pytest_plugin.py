"""The harness's pytest plugin: markers, options and fixtures shared by the repository's tests and the shipped battery.

Loaded by the repository's ``conftest.py`` from a checkout, or by the ``pytest11`` entry point once installed, so
another project can run ``pytest --pyargs harness.battery --recipe=theirpkg.module:attr``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.battery.checks import Verdict
from harness.recipes import RecipeError, load_recipe

DEFAULT_RECIPE = "harness.recipes:global_token_mean"

MARKERS = {
    "recipe": "the recipe battery: gradient-semantics checks of a recipe (--recipe=pkg.module:attr picks it)",
    "gpu": "needs one CUDA device",
    "gpu2": "needs two CUDA devices and NCCL (one rank per device)",
    "slow": "takes more than a few seconds; CI runs it, `-m 'not slow'` leaves it out locally",
    "required_gpus_missing": "set by harness.skips when HARNESS_REQUIRE_GPUS requires a GPU lane this machine cannot "
    "run: the test fails with the marker's message instead of skipping",
}

_PROPERTY = "battery_verdict"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddp-harness", "distributed gradient semantics")
    group.addoption(
        "--recipe", default=DEFAULT_RECIPE, metavar="PKG.MODULE:ATTR",
        help=f"the recipe the battery checks: an instance or a zero-argument factory (default: {DEFAULT_RECIPE})",
    )
    group.addoption(
        "--battery-report", default=None, metavar="PATH",
        help="write every battery check's verdict (world size, precision, pass/fail, max error, tolerance ratio) "
        "as JSON to PATH",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    # A bad --recipe is a usage error now, in the parent, not a traceback from deep inside a rank later.
    try:
        load_recipe(config.getoption("recipe"))
    except RecipeError as exc:
        raise pytest.UsageError(f"--recipe: {exc}") from None
    _check_required_gpus()
    _CONTROLLER_VERDICTS.clear()


# HARNESS_REQUIRE_GPUS: harness.skips decides at collection which GPU lanes must fail instead of skipping and marks
# their tests; this part refuses a bad value at start-up and fails the marked tests before any skip is evaluated.


def _check_required_gpus() -> None:
    from harness.skips import REQUIRE_GPUS_ENV, required_gpus

    try:
        required_gpus(os.environ.get(REQUIRE_GPUS_ENV))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    from harness.skips import REQUIRED_MARK

    for mark in item.iter_markers(name=REQUIRED_MARK):
        pytest.fail(str(mark.args[0]), pytrace=False)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Verdicts travel as the test report's user properties, which pytest-xdist sends from its workers to the
    # controller: so the controller alone sees every verdict, with or without -n.
    if report.when == "call":
        for name, value in report.user_properties:
            if name == _PROPERTY:
                _CONTROLLER_VERDICTS.append(value)  # type: ignore[arg-type]


_CONTROLLER_VERDICTS: list[dict[str, object]] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("battery_report")
    if not path or hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes the report
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    payload = {"recipe": session.config.getoption("recipe"), "checks": list(_CONTROLLER_VERDICTS)}
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(out)


@pytest.fixture(scope="session")
def recipe_path(pytestconfig: pytest.Config) -> str:
    """The ``package.module:attr`` of the recipe under test."""
    return str(pytestconfig.getoption("recipe"))


@pytest.fixture
def battery_check(request: pytest.FixtureRequest) -> Callable[[Verdict], None]:
    """Record a verdict for ``--battery-report`` and fail the test with its message unless it passed."""

    def check(verdict: Verdict) -> None:
        request.node.user_properties.append((_PROPERTY, verdict.to_dict()))
        if not verdict.passed:
            pytest.fail(verdict.message, pytrace=False)

    return check
