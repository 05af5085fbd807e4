"""Fixtures shared by the unit tests: seed 000's minimum config and its corpus, built once per session."""

from __future__ import annotations

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
