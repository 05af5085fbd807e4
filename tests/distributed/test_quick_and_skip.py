"""``--quick`` tells the main mistakes apart on real ranks, and ``--battery-skip`` works the same in pytest's lane as on
the command line: the check still runs, its test is skipped with the reason, the terminal summary says what it would
have said, and a failure it does not name still fails the session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.battery.plan import cases as plan
from harness.battery.plan.options import BatteryOptions
from harness.workflow.cli import main

ROOT = Path(__file__).parents[2]
CORRECT = "harness.recipes:global_token_mean"


def _signatures(report: Path, check: str) -> set[str]:
    """The diagnosis signatures of the report's failing ``check`` verdicts on the uneven and single scenarios."""
    checks = json.loads(report.read_text())["checks"]
    return {str(c["diagnosis"]["signature"]) for c in checks if c["check"] == check and c["status"] == "fail"
            and c["diagnosis"] and c["scenario"] in ("uneven", "single")}


@pytest.mark.slow  # four batteries of about 5 s each on an idle machine
def test_quick_tells_the_main_controls_apart_and_passes_the_correct_recipe(tmp_path: Path) -> None:
    """--quick: a per-microbatch mean reads as one on uneven, a mean of local means as one, a loop whose only
    microbatch never syncs fails one_sync and reads as unsynchronized; the correct recipe passes every quick case."""
    def quick(recipe: str) -> tuple[int, Path]:
        report = tmp_path / f"{recipe.split(':')[-1]}.json"
        return main(["battery", "--quick", "--recipe", f"harness.recipes:{recipe}", "--battery-report", str(report)]), \
            report

    status, report = quick("per_microbatch_mean")
    assert 1 == status and "per_microbatch_mean" in _signatures(report, "parity")
    status, report = quick("mean_of_local_means")
    assert 1 == status and "mean_of_local_means" in _signatures(report, "parity")
    assert "per_microbatch_mean" not in _signatures(report, "parity")
    status, report = quick("first_microbatch_never_syncs")
    failing = {(c["check"], c["scenario"]) for c in json.loads(report.read_text())["checks"] if c["status"] == "fail"}
    assert 1 == status and ("one_sync", "single") in failing
    assert {"not_synchronized"} == _signatures(report, "parity")
    status, report = quick(CORRECT.split(":")[-1])
    data = json.loads(report.read_text())
    assert (0, 0) == (status, data["counts"]["fail"])
    assert len(plan.session_cases(BatteryOptions.parse(quick=True))) + 1 == data["run"]  # the cases and one drawn lane


def _pytest(*args: str, narrow: tuple[str, ...] = ("--battery-world-sizes=2", "--precision=fp32")
            ) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                           "harness/battery/test_battery.py", "-m", "recipe", *narrow, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})


@pytest.mark.slow  # two pytest sessions of one launch each
def test_pytest_skips_a_named_check_with_its_reason_and_still_fails_on_another(tmp_path: Path) -> None:
    """pytest --battery-skip: a failing hygiene check skipped is exit 0, the skip's reason and "would have FAILED" in
    pytest's output, "skipped" in the report; with a per-microbatch mean, skipping hygiene (which passes: "would have
    passed") leaves parity failing: exit 1, and the battery summary groups it once."""
    report = tmp_path / "r.json"
    only = "uneven and random_generators"
    done = _pytest("--recipe=harness.recipes:python_random_shuffle", "-k", only, f"--battery-report={report}",
                   "--battery-skip", "hygiene=we shuffle on purpose")
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-2000:]
    assert "reason: we shuffle on purpose); it would have FAILED" in done.stdout
    assert "hygiene: skipped (reason: we shuffle on purpose); it would have FAILED in 1 case" in done.stdout
    assert ["skipped"] == [c["status"] for c in json.loads(report.read_text())["checks"]]
    assert (tmp_path / "r.txt").is_file()
    done = _pytest("--recipe=harness.recipes:per_microbatch_mean", "-k", "uneven and (random_generators or "
                   "single_device_reference)", "--battery-skip", "hygiene")
    assert 1 == done.returncode, done.stdout[-3000:] + done.stderr[-2000:]
    assert "hygiene: skipped (reason: no reason given); it would have passed in 1 case" in done.stdout
    assert "parity FAILED in 1 case (W=2; uneven; fp32)" in done.stdout and "battery summary" in done.stdout


@pytest.mark.slow  # two pytest processes, each importing torch; tests/unit/test_quick.py covers the plan in-process
def test_pytest_quick_collects_the_quick_plan() -> None:
    """pytest --quick collects one test per quick case and the one drawn lane, and an unknown --battery-skip name is
    a usage error naming the valid ones."""
    done = _pytest("--quick", "--collect-only", narrow=())
    collected = sorted(line.split("[")[-1].rstrip("]") for line in done.stdout.splitlines() if "-world" in line)
    assert sorted(c.id for c in plan.session_cases(BatteryOptions.parse(quick=True))) == collected, done.stdout[-2000:]
    done = _pytest("--battery-skip", "nope", "--collect-only")
    assert 4 == done.returncode and "nope is not a check of the battery" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow  # a torchrun job: a rendezvous plus a battery
@pytest.mark.xdist_group("torchrun-agents")
def test_torchrun_skips_a_named_check_and_runs_quick_s_cases(tmp_path: Path) -> None:
    """Under torchrun (two workers), --quick --battery-skip hygiene on a recipe that shuffles Python's generator: exit
    0 on every worker, only the quick scenarios in fp32 in the report, hygiene recorded as skipped, and rank 0's last
    screen says it would have failed."""
    from support.battery_jobs import job

    codes, text, report = job(tmp_path, "--recipe", "harness.recipes:python_random_shuffle", "--quick",
                              "--battery-skip", "hygiene=we shuffle on purpose", nodes=1, per_node=2)
    assert [0] == codes, text[-3000:]
    assert report is not None and {"uneven", "single", "one_empty"} >= {c["scenario"] for c in report["checks"]}
    assert {"fp32"} == {c["precision"] for c in report["checks"]}
    hygiene = [c for c in report["checks"] if c["check"] == "hygiene"]
    assert {"skipped"} == {c["status"] for c in hygiene}
    failing = sum(c["skipped_status"] == "fail" for c in hygiene)
    assert failing > 0
    assert f"hygiene: skipped (reason: we shuffle on purpose); it would have FAILED in {failing} cases" in text, \
        text[-3000:]
