"""The battery's JUnit XML (``harness.battery.report.junit``, ``python -m harness battery --battery-junit PATH``): one
test case per verdict and per control, failures and skips where they belong, counts that add up, and text escaped so
that any XML parser reads it back."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.battery.judge.verdict import FAIL, NOT_APPLICABLE, PASS, Verdict
from harness.battery.report.junit import junit_xml, write_junit
from harness.battery.report.table import ControlResult
from harness.workflow.cli import main

CORRECT = "harness.recipes:global_token_mean"
OTHER = "user_recipes.variants:ClassRecipe"
NASTY = "check parity FAILED: 1 < 2 & x\x01y\x1b[31m\nsecond line"


def _verdicts() -> list[Verdict]:
    diagnosis = {"signature": "mean_of_local_means", "line": "weights match the mean of local means <&>"}
    return [
        Verdict("parity", CORRECT, "uneven", 2, "fp32", PASS, "check parity passed", max_error=1e-7),
        Verdict("parity", OTHER, "uneven", 2, "fp32", FAIL, NASTY, cause="numbers", max_error=0.5,
                diagnosis=diagnosis, details="rank 0: Traceback\x00 (most recent call last)"),
        Verdict("empty_window", OTHER, "empty", 2, "fp64", NOT_APPLICABLE, "check empty_window not applicable: no"),
        Verdict("parity", OTHER, "drawn", 0, "fp32", PASS, "drawn passed", label="drawn (2 layouts, W in 2, fp32)"),
    ]


def _controls() -> list[ControlResult]:
    failed = Verdict("parity", "harness.recipes:mean_of_local_means", "uneven", 2, "fp32", FAIL,
                     "check parity FAILED: off by 2", cause="numbers")
    passed = Verdict("parity", "harness.recipes:missing_world_factor", "uneven", 3, "fp32", PASS,
                     "check parity passed")
    return [ControlResult("mean_of_local_means", failed, "numbers"),
            ControlResult("missing_world_factor", passed, "numbers")]


def check_counts(xml_text: str) -> list[str]:
    """Every suite's (and the whole document's) tests/failures/errors/skipped attributes against the cases it holds:
    what disagrees, as sentences (empty when every count is right)."""
    root = ET.fromstring(xml_text)
    wrong = []
    for element in [root, *root.iter("testsuite")]:
        cases = list(element.iter("testcase"))
        got = {"tests": len(cases), "failures": sum(c.find("failure") is not None for c in cases),
               "errors": sum(c.find("error") is not None for c in cases),
               "skipped": sum(c.find("skipped") is not None for c in cases)}
        wrong += [f"{element.get('name')}: {key}={element.get(key)}, counted {n}" for key, n in got.items()
                  if element.get(key) != str(n)]
    return wrong


def _suites(xml_text: str) -> dict[str, ET.Element]:
    return {str(s.get("name")): s for s in ET.fromstring(xml_text).iter("testsuite")}


def test_one_testcase_per_verdict_in_one_suite_per_recipe() -> None:
    text = junit_xml(_verdicts(), duration_s=1.5)
    root = ET.fromstring(text)
    assert ("testsuites", "harness.battery", "1.500") == (root.tag, root.get("name"), root.get("time"))
    suites = _suites(text)
    assert [CORRECT, OTHER] == list(suites)
    assert 4 == len(list(root.iter("testcase")))
    other = suites[OTHER]
    assert [("parity (uneven, W=2, fp32)", OTHER), ("empty_window (empty, W=2, fp64)", OTHER),
            ("drawn (2 layouts, W in 2, fp32)", OTHER)] == [(c.get("name"), c.get("classname")) for c in other]
    assert ("3", "1", "0", "1") == tuple(other.get(k) for k in ("tests", "failures", "errors", "skipped"))
    passed = suites[CORRECT].find("testcase")
    assert passed is not None and [] == list(passed)
    assert [] == check_counts(text)


def test_a_failure_holds_the_message_the_diagnosis_and_the_details_escaped() -> None:
    text = junit_xml(_verdicts())
    assert "\x01" not in text and "\x1b" not in text and "\x00" not in text
    assert "1 &lt; 2 &amp; x" in text  # escaped by ElementTree, not dropped
    failing = _suites(text)[OTHER][0]
    failure = failing.find("failure")
    assert failure is not None
    assert "check parity FAILED: 1 < 2 & xy[31m" == failure.get("message")  # the first line, control chars gone
    assert "numbers" == failure.get("type")
    body = failure.text or ""
    assert body.startswith("check parity FAILED: 1 < 2 & xy[31m\nsecond line")
    assert "diagnosis: weights match the mean of local means <&>" in body
    assert "rank 0: Traceback (most recent call last)" in body
    skipped = _suites(text)[OTHER][1].find("skipped")
    assert skipped is not None and "check empty_window not applicable: no" == skipped.get("message")


def test_controls_pass_when_rejected_and_fail_when_not() -> None:
    text = junit_xml(_verdicts(), _controls())
    suite = _suites(text)["negative controls"]
    cases = list(suite)
    assert ["mean_of_local_means: parity (uneven, W=2, fp32)", "missing_world_factor: parity (uneven, W=3, fp32)"] \
        == [c.get("name") for c in cases]
    assert [] == list(cases[0])
    failure = cases[1].find("failure")
    assert failure is not None
    assert "not rejected: check parity passed" == failure.get("message")
    assert ("2", "1", "0") == (suite.get("tests"), suite.get("failures"), suite.get("skipped"))
    root = ET.fromstring(text)
    assert ("6", "2", "1") == (root.get("tests"), root.get("failures"), root.get("skipped"))
    assert [] == check_counts(text)
    assert "negative controls" not in _suites(junit_xml(_verdicts()))


def test_check_counts_catches_a_miscounted_suite() -> None:
    """The negative control of the count check: a suite whose failures attribute is off is reported."""
    text = junit_xml(_verdicts(), _controls())
    root = ET.fromstring(text)
    suite = next(s for s in root.iter("testsuite") if s.get("name") == OTHER)
    suite.set("failures", "0")
    assert [f"{OTHER}: failures=0, counted 1"] == check_counts(ET.tostring(root, encoding="unicode"))


def test_write_junit_writes_atomically_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    out = write_junit(tmp_path / "sub" / "junit.xml", _verdicts(), _controls())
    assert out == tmp_path / "sub" / "junit.xml"
    assert [out] == list(out.parent.iterdir())
    assert [] == check_counts(out.read_text(encoding="utf-8"))


def test_the_command_line_writes_the_junit_file(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    """python -m harness battery --battery-junit PATH: the file parses and holds one test case per verdict (the
    cases monkeypatched, so that no rank starts)."""
    import harness.battery.report.table as table

    verdicts = [Verdict("parity", CORRECT, "uneven", 2, "fp32", PASS, "check parity passed"),
                Verdict("sync", CORRECT, "uneven", 2, "fp32", PASS, "check sync passed")]
    monkeypatch.setattr(table, "run_cases", lambda *args, **kwargs: verdicts)
    out = tmp_path / "junit.xml"
    assert 0 == main(["battery", "--recipe", CORRECT, "--battery-world-sizes", "2", "--precision", "fp32",
                      "--battery-examples", "0", "--battery-junit", str(out)])
    assert f"junit written to {out}" in capsys.readouterr().out
    root = ET.parse(out).getroot()
    assert ["parity (uneven, W=2, fp32)", "sync (uneven, W=2, fp32)"] == [c.get("name") for c in root.iter("testcase")]
    assert [] == check_counts(out.read_text(encoding="utf-8"))
