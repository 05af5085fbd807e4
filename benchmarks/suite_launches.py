"""A pytest plugin for ``benchmarks/suite_bench.py``: each test's duration (setup, call and teardown), how many
launches (:func:`harness.distributed.launcher.launches`) it started in the pytest process, and how many times the
launcher's forkserver (re)started during it (:func:`harness.distributed.forkserver.starts`: each a cold start).

Loaded with ``-p suite_launches`` (``benchmarks/`` on ``PYTHONPATH``); every process (the xdist controller and each
worker) writes what it saw to ``$SUITE_LAUNCHES_DIR/<worker>.json`` at the end of the session. Launches made by a
subprocess a test starts (``python -m harness battery`` run end to end) are not counted; their time is.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

_TESTS: dict[str, dict[str, Any]] = {}


def _launches() -> int:
    launcher = sys.modules.get("harness.distributed.launcher")
    return int(launcher.launches()) if launcher is not None else 0


def _starts() -> int:
    server = sys.modules.get("harness.distributed.forkserver")
    return int(server.starts()) if server is not None else 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    before, started = _launches(), _starts()
    yield
    entry = _TESTS.setdefault(item.nodeid, {"seconds": 0.0, "launches": 0, "outcome": "passed"})
    entry["launches"] += _launches() - before
    entry["server_starts"] = entry.get("server_starts", 0) + _starts() - started


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _TESTS.setdefault(report.nodeid, {"seconds": 0.0, "launches": 0, "outcome": "passed"})
    entry["seconds"] += float(report.duration)
    if report.failed:
        entry["outcome"] = "failed"
    elif report.skipped and entry["outcome"] != "failed":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = os.environ.get("SUITE_LAUNCHES_DIR")
    if not folder:
        return
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    if worker is None and session.config.pluginmanager.hasplugin("dsession"):
        return  # the xdist controller: it runs no test, and its reports' launches are the workers' to count
    Path(folder, f"{worker or 'main'}.json").write_text(json.dumps(_TESTS))
