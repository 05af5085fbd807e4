"""Fixtures shared by the unit tests: seed 000's minimum config and its corpus, built once per session; a zombie."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.data.config import Config, load_config
from harness.data.corpus import Row, make_corpus

MINIMUM = Path(__file__).resolve().parents[2] / "configs" / "minimum.yaml"


@pytest.fixture(scope="session")
def config() -> Config:
    """configs/minimum.yaml, loaded."""
    return load_config(MINIMUM)


@pytest.fixture(scope="session")
def rows(config: Config) -> list[Row]:
    """The minimum config's corpus, every split."""
    return make_corpus(config)


@pytest.fixture
def zombie_pid() -> Iterator[int]:
    """The pid of a child that has exited and is not reaped until the test ends (Linux: read through /proc)."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("a zombie is recognized through /proc")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(") ", 1)[1][:1] != "Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        yield child.pid
    finally:
        child.wait(30)
