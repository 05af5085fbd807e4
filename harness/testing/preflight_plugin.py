"""The pytest face of the pre-flight and of the quiet rank output, registered by :mod:`harness.testing.plugin`.

- Before any test, once, in the controlling process (not in an xdist worker) and only when a battery test is
  selected: the recipe on the smallest case (:mod:`harness.battery.launch.preflight`); a recipe that raises there ends
  the session with one message and exit status 1, unless ``--battery-keep-going``.
- What the battery's ranks printed is collected (:mod:`harness.battery.launch.printed`; xdist workers send theirs to the
  controller) and said once in the terminal summary, before the battery's summary: each distinct line with how many
  ranks and launches printed it, every line under ``-v``. Each test's own captured output stays as pytest keeps it.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.battery.launch import printed

_PRINTED = printed.Printed()
"""What the ranks of this session's battery launches printed."""

_DONE: list[bool] = []


def pytest_configure(config: pytest.Config) -> None:
    _PRINTED.ranks.clear()
    _PRINTED.launches.clear()
    _DONE.clear()
    printed.start(False, _PRINTED)


def _preflight(config: pytest.Config) -> None:
    if _DONE or config.getoption("battery_keep_going"):
        return
    _DONE.append(True)
    from harness.battery.launch.preflight import session_preflight
    from harness.battery.plan.options import from_pytest
    from harness.recipes import CORRECT_RECIPE

    try:
        options = from_pytest(config)  # harness.testing.plugin's options_from, without importing that module
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    stopped = session_preflight(str(config.getoption("recipe") or CORRECT_RECIPE), options)
    if stopped:
        pytest.exit(stopped, returncode=1)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput") and any(
            item.get_closest_marker("recipe") is not None for item in session.items):
        _preflight(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    # The xdist controller collects nothing itself: the ids its workers collected say whether a battery test runs,
    # and it hears them before it schedules any test.
    from harness.battery.launch.preflight import BATTERY_CASE_ID

    if any(BATTERY_CASE_ID.search(i) for i in ids):
        _preflight(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    out = getattr(node, "workeroutput", None) or {}
    if "battery_printed" in out:
        _PRINTED.merge(out["battery_printed"])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its ranks' prints go to the controller's summary
        workeroutput["battery_printed"] = _PRINTED.as_dict()


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    lines = _PRINTED.lines(None if config.option.verbose > 0 else printed.SHOWN)
    if lines:
        terminalreporter.write_sep("=", "what the battery's ranks printed (each distinct line once)")
        for line in lines:
            terminalreporter.write_line(f"  {line}")


def pytest_unconfigure(config: pytest.Config) -> None:
    printed.stop(_PRINTED)
