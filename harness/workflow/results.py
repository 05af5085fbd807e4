"""The report's result types: one named check with its outcome, and the report that gathers them.

Their own module so that the code that fills a report (:mod:`harness.workflow.report`) and the code that writes it
(:mod:`harness.workflow.render`) both import them and neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Check:
    """One of the report's checks: its name, whether it holds, and the numbers behind it in one line."""

    name: str
    passed: bool
    detail: str


@dataclass
class Report:
    """Everything the ``report`` command measured (``results``, JSON-ready) and its checks."""

    config_path: str
    outputs: Path
    results: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]


__all__ = ["Check", "Report"]
