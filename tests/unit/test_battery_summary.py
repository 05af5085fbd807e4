"""The battery's last screen (``harness.battery.report.summary``): failing verdicts grouped by check and reading, each
group once with its count, where, its reading, one case's numbers and its fix; the compact table; the skipped checks
with what they would have said; the full report always written; and the command line and torchrun's rank 0 ending on
it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.battery import dist
from harness.battery.judge.verdict import FAIL, NOT_APPLICABLE, PASS, SKIPPED, Verdict
from harness.battery.plan.options import BatteryOptions
from harness.battery.plan.skips import skip, skip_all
from harness.battery.report import summary
from harness.battery.report.junit import junit_xml
from harness.workflow.cli import main

R = "harness.recipes:per_microbatch_mean"
PMM = {"signature": "per_microbatch_mean", "line": "diagnosis (per_microbatch_mean): a mean per microbatch; rank 0's "
       "microbatch 1's tokens weigh 2x rank 0's microbatch 0's", "fix": "divide by the window's global count"}
MOLM = {"signature": "mean_of_local_means", "line": "diagnosis (mean_of_local_means): each rank divided by its own "
        "count"}


def _v(check: str, scenario: str, world: int, precision: str, status: str = FAIL, *, diagnosis: dict | None = None,
       cause: str | None = "numbers", error: float = 0.07, fix: str | None = None, finding: str | None = None,
       recipe: str = R) -> Verdict:
    head = {FAIL: "FAILED", PASS: "passed", NOT_APPLICABLE: "not applicable"}[status]
    message = (f"check {check} {head}: recipe {recipe}, world {world}, window 0, {precision}, scenario {scenario}: "
               f"max abs error {error:.3e}; more words after the numbers")
    return Verdict(check, recipe, scenario, world, precision, status, message,
                   cause=cause if status == FAIL else None, max_error=error, diagnosis=diagnosis, fix=fix,
                   finding=finding)


def _battery() -> list[Verdict]:
    """A per-microbatch mean as the battery sees it: parity fails with one diagnosis on most cases and another on the
    single scenario; one_sync fails on numbers alone; a run crashes; the rest passes or does not apply."""
    out = [_v("parity", s, w, p, diagnosis=PMM) for s in ("uneven", "long") for w in (2, 3) for p in ("fp32", "fp64")]
    out += [_v("parity", "single", w, "fp32", diagnosis=MOLM, error=0.04) for w in (2, 3)]
    out += [_v("one_sync", "uneven", w, "fp32") for w in (2, 3)]
    out += [_v("hygiene", "uneven", 2, "fp32", cause="crash")]
    out += [_v("ranks_agree", s, 2, "fp32", PASS) for s in ("uneven", "long", "single")]
    out += [_v("clipping", "uneven", 2, "fp32", NOT_APPLICABLE)]
    return out


def test_failures_group_by_check_and_reading_in_the_battery_s_order() -> None:
    """Eight parity failures read as per_microbatch_mean, two as mean_of_local_means, two one_sync failures on
    numbers and one crash make four groups, in the order their first failure came."""
    groups = summary.failing_groups(_battery())
    assert [("parity", ("diagnosis", "per_microbatch_mean"), 8), ("parity", ("diagnosis", "mean_of_local_means"), 2),
            ("one_sync", ("numbers", ""), 2), ("hygiene", ("cause", "crash"), 1)] == [
        (g.check, g.key, len(g.verdicts)) for g in groups]


def test_a_finding_groups_apart_from_a_plain_numbers_failure() -> None:
    """A failure with a named finding (float32 computation) is its own group, beside the plain ones of its check."""
    verdicts = [_v("parity", "uneven", 2, "fp64", finding="float32_computation"), _v("parity", "long", 2, "fp64")]
    assert [("finding", "float32_computation"), ("numbers", "")] == [g.key for g in summary.failing_groups(verdicts)]


def test_a_group_says_its_cases_where_its_reading_one_case_s_numbers_and_its_fix() -> None:
    """The per-microbatch group: eight cases at W=2,3 on uneven and long in fp32 and fp64, the diagnosis line once,
    the first case's numbers (up to the message's first "; "), and the diagnosis's fix."""
    text = "\n".join(summary.format_group(summary.failing_groups(_battery())[0]))
    assert "parity FAILED in 8 cases (W=2,3; uneven, long; fp32, fp64)" in text
    assert 1 == text.count("a mean per microbatch")
    assert "e.g. parity (uneven, W=2, fp32): max abs error 7.000e-02" in text
    assert "more words" not in text
    assert "fix: divide by the window's global count" in text


def test_the_verdict_s_own_fix_wins_over_the_diagnosis_s() -> None:
    """``Verdict.fix`` (the fixes' field) is the fix printed; the diagnosis's ``fix`` key stands in where it is None."""
    verdicts = [_v("parity", "uneven", 2, "fp32", diagnosis=PMM, fix="count once per window")]
    assert "count once per window" == summary.failing_groups(verdicts)[0].fix
    assert summary.failing_groups([_v("one_sync", "uneven", 2, "fp32")])[0].fix is None


def test_the_summary_prints_each_reading_once_however_many_cases_share_it() -> None:
    """Forty cases with one diagnosis: the diagnosis line appears once on the last screen, not forty times."""
    verdicts = [_v("parity", "uneven", w, p, diagnosis=PMM) for w in (1, 2, 3, 4) for p in ("fp32", "fp64")] * 5
    text = summary.format_summary(verdicts, "/tmp/r.json", "/tmp/r.txt")
    assert 1 == text.count("a mean per microbatch")
    assert "40 cases" in text and text.endswith("full report: /tmp/r.json (every verdict's whole message: /tmp/r.txt)")


def test_the_compact_table_keeps_failing_rows_and_counts_the_rest() -> None:
    """Failing rows print (up to the limit); the passing rows and the n/a one are one line saying how to see them."""
    text = summary.compact_table(_battery(), max_rows=20)
    assert "parity (uneven, W=2, fp32)" in text and "ranks_agree" not in text and "clipping" not in text
    assert text.splitlines()[-1] == "and 4 row(s) not shown: 3 pass, 1 n/a (-v prints every row)"


def test_the_compact_table_stops_at_its_row_limit_and_counts_the_failing_rows_past_it() -> None:
    """Past ``max_rows`` failing rows the table says how many more failed (the groups below say where)."""
    text = summary.compact_table(_battery(), max_rows=3)
    assert 3 + 2 + 1 == len(text.splitlines())  # header, rule, three rows, the count
    assert "10 more failing or skipped (grouped below)" in text.splitlines()[-1]


def test_a_skipped_check_that_would_have_failed_says_where_and_why() -> None:
    """--battery-skip one_sync on a failing one_sync: no failing group is left for it, the skipped section gives the
    reason, the cases it would have failed in and its reading."""
    verdicts = skip_all(_battery(), [("one_sync", "our loop syncs every microbatch on purpose")])
    assert ["parity", "parity", "hygiene"] == [g.check for g in summary.failing_groups(verdicts)]
    text = summary.format_summary(verdicts)
    assert ("one_sync: skipped (reason: our loop syncs every microbatch on purpose); it would have FAILED in 2 cases"
            in text)
    assert "2 cases (W=2,3; uneven; fp32):" in text


def test_a_skipped_check_that_would_have_passed_says_so() -> None:
    """The negative control: skipping ranks_agree, which passes everywhere, reads "it would have passed", not FAILED."""
    text = summary.format_summary(skip_all(_battery(), [("ranks_agree", "no reason given")]))
    assert "ranks_agree: skipped (reason: no reason given); it would have passed in 3 cases" in text
    assert "ranks_agree: skipped (reason: no reason given); it would have FAILED" not in text


def test_a_skipped_verdict_keeps_what_it_would_have_been_and_does_not_fail() -> None:
    """Skipped: status "skipped", its old status and message kept, ``passed`` True; a check not named is unchanged."""
    failing = _v("one_sync", "uneven", 2, "fp32")
    got = skip(failing, [("one_sync", "on purpose")])
    assert (SKIPPED, FAIL, "on purpose", failing.message, True) == (
        got.status, got.skipped_status, got.skip_reason, got.message, got.passed)
    assert failing == skip(failing, [("parity", "other")])
    assert False is failing.passed


def test_a_verdict_comes_back_from_its_dict() -> None:
    """pytest's verdicts travel as dicts: read back, they are the same verdicts (``passed`` dropped, notes a tuple)."""
    v = _v("parity", "uneven", 2, "fp32", diagnosis=PMM)
    v = Verdict(**{**v.__dict__, "notes": ("the model has dropout",)})
    assert v == summary.verdict_from_dict(json.loads(json.dumps(v.to_dict())))


def test_the_full_report_is_written_to_a_fresh_folder_when_no_path_is_given(tmp_path: Path) -> None:
    """No --battery-report: report.json in a new harness-battery- folder, every whole message beside it in
    report.txt; with a path, there and at NAME.txt."""
    verdicts = _battery()
    report, text = summary.write_full_report(None, {"checks": [v.to_dict() for v in verdicts]}, verdicts)
    assert report.parent.name.startswith("harness-battery-") and "report.json" == report.name
    assert all(v.message in text.read_text() for v in verdicts)
    mine, beside = summary.write_full_report(tmp_path / "out.json", {"checks": []}, verdicts)
    assert (tmp_path / "out.json", tmp_path / "out.txt") == (mine, beside)


def test_junit_records_a_skipped_check_as_skipped_with_its_reason() -> None:
    """--battery-skip's verdicts are <skipped> test cases whose message names the reason and what they would have
    said; the suite counts them as skipped, not as failures."""
    xml = junit_xml(skip_all(_battery(), [("hygiene", "we seed ourselves")]))
    assert 'message="check hygiene skipped (--battery-skip, reason: we seed ourselves); it would have FAILED' in xml
    assert 'failures="12"' in xml and 'skipped="2"' in xml


def test_rank_0_under_torchrun_ends_on_the_summary_and_exits_0_when_only_skipped_checks_failed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The torchrun entry's report: a skipped failing check exits 0 and the summary says it would have failed; the
    same verdicts without the skip exit 1 (the negative control)."""
    only = [_v("one_sync", "uneven", 2, "fp32"), _v("parity", "uneven", 2, "fp32", PASS)]
    skipping = BatteryOptions.parse(skip=["one_sync=on purpose"], report=str(tmp_path / "r.json"))
    assert 0 == dist._report(R, skipping, [], list(only), None, None, 1.0, 2)
    out = capsys.readouterr().out
    assert "one_sync: skipped (reason: on purpose); it would have FAILED in 1 case" in out
    assert "every check holds" == out.strip().splitlines()[-1]
    assert ["skipped", "pass"] == [c["status"] for c in json.loads((tmp_path / "r.json").read_text())["checks"]]
    assert 1 == dist._report(R, BatteryOptions(), [], list(only), None, None, 1.0, 2)


def test_an_unknown_check_name_for_battery_skip_is_bad_input_naming_the_valid_ones(
    capsys: pytest.CaptureFixture[str]
) -> None:
    """--battery-skip no_such_check: exit 2 before any run, the message lists the registry's checks and drawn."""
    assert 2 == main(["battery", "--battery-skip", "no_such_check=because", "--battery-examples", "0"])
    said = capsys.readouterr().err
    assert "--battery-skip='no_such_check=because': no_such_check is not a check of the battery" in said
    assert "parity, one_sync" in said and "drawn" in said


def _failing_hygiene(recipe: str, cases: list, options: BatteryOptions | None = None, progress: object = None,
                     ) -> list[Verdict]:
    """run_cases as a recipe that moves a global generator: hygiene fails, parity passes (no launch)."""
    return [_v("hygiene", "uneven", 2, "fp32", recipe=recipe), _v("parity", "uneven", 2, "fp32", PASS, recipe=recipe)]


def test_the_command_line_exits_0_when_only_skipped_checks_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--battery-skip hygiene on a failing hygiene: exit 0, the full report's table shows SKIP (FAIL), the summary what
    it would have said, the report records "skipped"; without the skip the same run exits 1 (the negative control)."""
    import harness.battery.report.table as table

    monkeypatch.setattr(table, "run_cases", _failing_hygiene)
    common = ["battery", "--recipe", R, "--battery-examples", "0", "--battery-world-sizes", "2", "--precision", "fp32"]
    report = tmp_path / "r.json"
    assert 0 == main([*common, "--battery-skip", "hygiene=we shuffle on purpose", "--battery-report", str(report)])
    out = capsys.readouterr().out
    assert "SKIP (FAIL)" in (tmp_path / "r.txt").read_text()
    assert "hygiene: skipped (reason: we shuffle on purpose); it would have FAILED in 1 case" in out
    assert out.strip().splitlines()[-1].startswith("every check holds (skipped: hygiene")
    data = json.loads(report.read_text())
    assert ({"pass": 1, "fail": 0, "n/a": 0, "skipped": 1}, 0) == (data["counts"], data["exit_status"])
    assert (tmp_path / "r.txt").is_file()
    assert 1 == main(common)


def test_a_failing_check_not_skipped_still_exits_1(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """--battery-skip parity (which passes) leaves the hygiene failure standing: exit 1, the summary's group names
    it, and the skipped parity says it would have passed."""
    import harness.battery.report.table as table

    monkeypatch.setattr(table, "run_cases", _failing_hygiene)
    assert 1 == main(["battery", "--recipe", R, "--battery-examples", "0", "--battery-world-sizes", "2",
                      "--precision", "fp32", "--battery-skip", "parity"])
    captured = capsys.readouterr()
    assert "hygiene FAILED in 1 case (W=2; uneven; fp32)" in captured.out
    assert "parity: skipped (reason: no reason given); it would have passed in 1 case" in captured.out
    assert captured.err.strip().splitlines()[-1].startswith("FAILED: 1 check(s) failed; first: hygiene")
    assert "full report: " in captured.out  # written to a fresh folder, named on the last screen


def test_a_passing_check_s_consequence_is_said_once_with_where_it_held() -> None:
    """The empty window's NaN logged loss beside zero gradients passes with a note (the optimizer still steps): the
    last screen says it once for its cases, since the compact table shows no passing row to footnote."""
    note = "ranks 0, 1 logged nan beside zero gradients: the optimizer still steps"
    verdicts = [Verdict("empty_window", R, "all_empty", w, "fp32", PASS, "passed", finding="nan_logged_loss",
                        notes=(note,)) for w in (1, 2)]
    screen = summary.format_summary(verdicts)
    assert 1 == screen.count("the optimizer still steps")
    assert "empty_window (2 cases: W=1,2; all_empty; fp32)" in screen


def test_a_pass_without_a_finding_adds_no_note() -> None:
    """The negative control: a plain pass, even one carrying notes of the run, says nothing on the last screen."""
    verdicts = [Verdict("parity", R, "uneven", 2, "fp32", PASS, "passed", notes=("the model ...",))]
    assert "" == summary.format_summary(verdicts)


def test_a_fix_the_group_before_gave_is_not_repeated() -> None:
    """Two readings of one mistake with one fix: the recipe-level reading says it, and each group says the fix is the
    same as above; a group with another fix says its own (the negative control)."""
    verdicts = [_v("parity", "uneven", 2, "fp32", diagnosis=PMM, fix="divide by N"),
                _v("parity", "single", 2, "fp32", diagnosis=MOLM, fix="divide by N"),
                _v("one_sync", "uneven", 2, "fp32", fix="use no_sync")]
    screen = summary.format_summary(verdicts)
    assert 1 == screen.count("fix: divide by N")
    assert 2 == screen.count("fix: the same as above")
    assert "fix: use no_sync" in screen


def test_the_summary_line_names_where_the_cases_ran() -> None:
    """A mesh run's cases ran over the mesh alone: the last line and the report name it and its W, never the dp=W
    world sizes the battery would run without --mesh (which it said before: the control)."""
    from dataclasses import replace

    from harness.core.mesh import Mesh
    from harness.workflow.checks import ran_at, where_run

    mesh = Mesh.parse("dp=2,cp=2")
    over_mesh = [replace(_v("parity", "uneven", 4, "fp32", PASS), mesh="dp=2,cp=2")]
    assert "over mesh dp=2,cp=2 (W=4)" == where_run((2, 3), [mesh], over_mesh)
    assert "[2, 3]" not in where_run((2, 3), [mesh], over_mesh)
    assert [4] == ran_at((2, 3), [mesh], over_mesh)
    flat = [_v("parity", "uneven", w, "fp32", PASS) for w in (2, 3)]
    assert "at world sizes [2, 3]" == where_run((1, 2, 3), [], flat)
    assert [2, 3] == ran_at((1, 2, 3), [], flat)
    assert "at world sizes [2], the cases over mesh dp=2,cp=2 (W=4)" == where_run((2,), [mesh], [*flat[:1], *over_mesh])
    assert [2] == ran_at((2,), [], [])
