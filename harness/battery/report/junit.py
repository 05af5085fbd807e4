"""The battery's verdicts as a JUnit XML report, for CI systems (``python -m harness battery --battery-junit PATH``;
the pytest lane writes its own with pytest's ``--junitxml=PATH``, one test case per verdict there too).

One ``<testsuite>`` per recipe under test (named by its import path, so writing the report loads no recipe), one
``<testcase>`` per verdict: a failing verdict holds a ``<failure>``, a check that does not apply a ``<skipped>``, so
does a check ``--battery-skip`` named (its message: the reason and what it would have said), a pass nothing. The
negative controls, when given, make one more suite: a control's case passes when its targeted check rejected it, and
fails otherwise."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from harness.battery.judge.verdict import FAIL, NOT_APPLICABLE, SKIPPED, Verdict
from harness.battery.plan.skips import skip_message
from harness.battery.report.table import ControlResult, row_label, write_text_atomic

CONTROLS_SUITE = "negative controls"

_FORBIDDEN = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""Characters XML 1.0 cannot hold, escaped or not: control characters other than tab, newline and carriage return,
lone surrogates, U+FFFE and U+FFFF."""


def clean(text: object) -> str:
    """``text`` as a string XML 1.0 can hold: its forbidden characters removed (escaping is ElementTree's)."""
    return _FORBIDDEN.sub("", str(text))


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def _failure_text(v: Verdict) -> str:
    parts = [v.message]
    line = (v.diagnosis or {}).get("line")
    if line:
        parts.append(f"diagnosis: {line}")
    if v.details:
        parts.append(v.details)
    return "\n\n".join(parts)


def _case(parent: ET.Element, classname: str, name: str) -> ET.Element:
    return ET.SubElement(parent, "testcase", {"classname": clean(classname), "name": clean(name)})


def _child(case: ET.Element, tag: str, message: str, text: str | None = None, kind: str | None = None) -> None:
    attrs = {"message": clean(message)}
    if kind is not None:
        attrs["type"] = clean(kind)
    element = ET.SubElement(case, tag, attrs)
    if text:
        element.text = clean(text)


def _suite(root: ET.Element, name: str, tests: int, failures: int, skipped: int) -> ET.Element:
    return ET.SubElement(root, "testsuite", {"name": clean(name), "tests": str(tests), "failures": str(failures),
                                             "errors": "0", "skipped": str(skipped)})


def control_name(c: ControlResult) -> str:
    """A control's test case: ``"{control}: {check} ({scenario}, W={w}, {precision})"``."""
    v = c.verdict
    return f"{c.control}: {v.check} ({v.scenario}, W={v.world_size}, {v.precision})"


def junit_xml(verdicts: Sequence[Verdict], controls: Sequence[ControlResult] = (), *,
              suite_name: str = "harness.battery", duration_s: float | None = None) -> str:
    """The JUnit XML document of ``verdicts`` (one suite per recipe, in the order they first appear) and
    ``controls`` (one more suite, :data:`CONTROLS_SUITE`, when there are any); ``duration_s``, when given, is the
    whole run's ``time``."""
    root = ET.Element("testsuites", {"name": clean(suite_name)})
    totals = [0, 0, 0]  # tests, failures, skipped
    for recipe in dict.fromkeys(v.recipe for v in verdicts):
        mine = [v for v in verdicts if v.recipe == recipe]
        failures = sum(v.status == FAIL for v in mine)
        skipped = sum(v.status in (NOT_APPLICABLE, SKIPPED) for v in mine)
        suite = _suite(root, recipe, len(mine), failures, skipped)
        for v in mine:
            case = _case(suite, recipe, row_label(v))
            if v.status == FAIL:
                _child(case, "failure", _first_line(v.message), _failure_text(v), v.cause or "failure")
            elif v.status == NOT_APPLICABLE:
                _child(case, "skipped", _first_line(v.message))
            elif v.status == SKIPPED:
                _child(case, "skipped", skip_message(v), _failure_text(v))
        totals = [totals[0] + len(mine), totals[1] + failures, totals[2] + skipped]
    if controls:
        unrejected = [c for c in controls if not c.rejected]
        suite = _suite(root, CONTROLS_SUITE, len(controls), len(unrejected), 0)
        for c in controls:
            case = _case(suite, c.verdict.recipe, control_name(c))
            if not c.rejected:
                v = c.verdict
                got = "passed" if v.status != FAIL else f"failed with cause {v.cause}"
                text = (f"expected its targeted check to fail with cause {c.shows_as}; it {got}\n\n"
                        f"{_failure_text(v)}")
                _child(case, "failure", f"not rejected: {_first_line(v.message)}", text, "not_rejected")
        totals = [totals[0] + len(controls), totals[1] + len(unrejected), totals[2]]
    root.attrib.update({"tests": str(totals[0]), "failures": str(totals[1]), "errors": "0",
                        "skipped": str(totals[2])})
    if duration_s is not None:
        root.set("time", f"{duration_s:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(path: str | Path, verdicts: Sequence[Verdict], controls: Sequence[ControlResult] = (), *,
                suite_name: str = "harness.battery", duration_s: float | None = None) -> Path:
    """Write :func:`junit_xml` atomically (:func:`harness.battery.report.table.write_text_atomic`) to ``path``."""
    return write_text_atomic(path, junit_xml(verdicts, controls, suite_name=suite_name, duration_s=duration_s))
