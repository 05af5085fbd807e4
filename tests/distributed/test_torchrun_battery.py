"""The battery inside torchrun (``python -m harness.battery.dist``): two torchrun agents on 127.0.0.1, two workers
each, gloo, c10d rendezvous, as a two-node job runs. Slow tier: each job is a rendezvous plus a battery (10-30 s), run
under ``timeout -k`` so no agent or worker outlives its test."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from support.battery_jobs import job

from harness.battery.judge import checks
from harness.battery.launch import runner

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("torchrun-agents")]


def test_the_correct_recipe_passes_every_check_across_two_agents(tmp_path: Path) -> None:
    junit = tmp_path / "battery.xml"
    codes, text, report = job(tmp_path, "--recipe", "harness.recipes:global_token_mean", "--precision", "fp32",
                               "--battery-junit", str(junit))
    assert [0, 0] == codes, text[-3000:]
    assert report is not None and 0 == report["exit_status"] and [4] == report["world_sizes"]
    assert report["expected"] == report["run"] == report["counts"]["pass"] + report["counts"]["n/a"]
    cases = ET.parse(junit).getroot().findall(".//testcase")
    assert len(cases) == report["run"] and not ET.parse(junit).getroot().findall(".//failure")
    # The references and checks are dealt over the ranks, not left to rank 0: 8 runs at W=4 (the eight scenarios)
    # give 2 each.
    # Found anywhere in the agents' output: under load two workers' lines can land on one line of the text.
    shares = sorted(int(n) for n in re.findall(r"prepared and judged (\d+) of ", text))
    assert [2, 2, 2, 2] == shares, text[-3000:]


@pytest.mark.parametrize(("name", "scenario", "cause"), [("mean_of_local_means", "uneven", "numbers"),
                                                         ("skip_backward_when_empty", "one_empty", "desync")])
def test_a_control_fails_the_same_check_the_same_way_as_in_process(tmp_path: Path, name: str, scenario: str,
                                                                   cause: str) -> None:
    """The numbers and their diagnosis; or a rank that refuses a window alone while its peers wait in a collective,
    named with its window from the notices every rank published, as the in-process launcher names it."""
    recipe = f"harness.recipes:{name}"
    codes, text, report = job(tmp_path, "--recipe", recipe, "--precision", "fp32", "--scenarios", scenario,
                              "--battery-deadline", "10")
    assert [1, 1] == codes, text[-3000:]
    assert report is not None and 1 == report["exit_status"]
    parity = next(c for c in report["checks"] if c["check"] == "parity")
    here = checks.parity(runner.run(recipe, scenario, 4, "fp32"))
    assert ("fail", cause) == (parity["status"], parity["cause"]) == (here.status, here.cause)
    if cause == "numbers":
        assert here.diagnosis is not None and parity["diagnosis"]["signature"] == here.diagnosis["signature"]
    else:  # the ranks' own records name the window first (published to torchrun's store), then what ended the run
        said = "rank 0 skipped the forward and backward of window 0 (no gradient synchronization): every rank must run"
        assert said in parity["message"], parity["message"]
        assert said in here.message, here.message  # the same sentence the in-process launcher gives


def test_a_rank_that_raises_stops_every_worker_naming_it(tmp_path: Path) -> None:
    codes, text, report = job(tmp_path, "--recipe", "user_recipes.broken:CrashesOnRankOne", "--precision", "fp32",
                               "--battery-deadline", "10")
    assert all(c != 0 for c in codes), text[-3000:]
    assert "FAILED: rank 1 of 4 raised KeyError: 'labels'" in text, text[-3000:]
    assert report is not None and 1 == report["exit_status"]
    assert {"crash", "stopped"} == {c["cause"] for c in report["checks"] if c["status"] == "fail"}
    # What does not fail is what cannot apply to this recipe, known before any rank started: it does not clip.
    assert {"clipping"} >= {c["check"] for c in report["checks"] if c["status"] != "fail"}


def test_a_worker_killed_mid_battery_ends_thejob(tmp_path: Path) -> None:
    """torchrun stops the other workers of the job; nothing waits for the killed one past the job's timeout."""
    codes, text, _ = job(tmp_path, "--recipe", "user_recipes.broken:KilledOnRankThree", "--precision", "fp32",
                          "--battery-deadline", "10")
    assert all(c != 0 for c in codes), text[-3000:]
    assert "SIGKILL" in text or "-9" in text, text[-3000:]


def test_a_count_over_the_node_local_ranks_fails_across_agents_and_passes_on_one(tmp_path: Path) -> None:
    """The bug torchrun across nodes exists to catch: the token count all-reduced over a node's ranks only."""
    recipe = "harness.recipes:count_over_local_ranks"
    args = ("--recipe", recipe, "--precision", "fp32", "--scenarios", "uneven")
    codes, text, report = job(tmp_path, *args)
    assert [1, 1] == codes, text[-3000:]
    assert report is not None
    parity = next(c for c in report["checks"] if c["check"] == "parity")
    assert "fail" == parity["status"] and "subgroup_count" == parity["diagnosis"]["signature"], parity["message"]
    codes, text, report = job(tmp_path, *args, nodes=1, per_node=4)
    assert [0] == codes, text[-3000:]


def test_bad_input_exits_2_on_every_worker_before_any_joins(tmp_path: Path) -> None:
    _, text, report = job(tmp_path, "--recipe", "no.such.module:recipe", nodes=1)
    assert report is None
    assert "bad input: " in text and "exitcode  : 2" in text, text[-3000:]


def test_a_mesh_runs_across_two_agents_with_cp_within_each(tmp_path: Path) -> None:
    """``--mesh dp=2,cp=2`` on 2 agents x 2 workers: ranks 0-1 (one agent) are a cp group, dp spans the agents. The
    mesh recipe passes every check; the count over dp only fails parity on the numbers, as in-process."""
    codes, text, report = job(tmp_path, "--recipe", "harness.recipes:mesh_token_mean", "--precision", "fp32",
                              "--mesh", "dp=2,cp=2")
    assert [0, 0] == codes, text[-3000:]
    assert "at W=4, mesh dp=2,cp=2" in text, text[-3000:]
    assert report is not None and 0 == report["exit_status"]
    assert report["expected"] == report["run"] == report["counts"]["pass"] + report["counts"]["n/a"]
    assert {"dp=2,cp=2"} == {c["mesh"] for c in report["checks"]}, report["checks"][:1]
    recipe = "harness.recipes:count_over_dp_only"
    codes, text, report = job(tmp_path, "--recipe", recipe, "--precision", "fp32", "--scenarios", "uneven",
                              "--mesh", "dp=2,cp=2")
    assert [1, 1] == codes, text[-3000:]
    assert report is not None
    parity = next(c for c in report["checks"] if c["check"] == "parity")
    assert ("fail", "numbers") == (parity["status"], parity["cause"]), parity["message"]


def test_expert_parallelism_runs_across_two_agents_with_the_expert_data_group_between_them(tmp_path: Path) -> None:
    """``--mesh dp=2,ep=2 --model harness.moe:moe`` on 2 agents x 2 workers: ranks 0-1 (one agent) are an ep group,
    each holding 2 of the 4 experts, and each expert's expert-data group ({0, 2} and {1, 3}) spans the agents. The
    mesh recipe passes every check; the experts averaged over the expert-data group fail parity on the numbers, read
    as ep times too large, as in-process."""
    codes, text, report = job(tmp_path, "--recipe", "harness.recipes:mesh_token_mean", "--precision", "fp32",
                              "--mesh", "dp=2,ep=2", "--model", "harness.moe:moe")
    assert [0, 0] == codes, text[-3000:]
    assert report is not None and 0 == report["exit_status"]
    assert report["expected"] == report["run"] == report["counts"]["pass"] + report["counts"]["n/a"]
    assert {"dp=2,ep=2"} == {c["mesh"] for c in report["checks"]}, report["checks"][:1]
    codes, text, report = job(tmp_path, "--recipe", "harness.recipes:experts_averaged_over_expert_data",
                              "--precision", "fp32", "--scenarios", "uneven", "--mesh", "dp=2,ep=2",
                              "--model", "harness.moe:moe")
    assert [1, 1] == codes, text[-3000:]
    assert report is not None
    parity = next(c for c in report["checks"] if c["check"] == "parity")
    assert ("fail", "numbers") == (parity["status"], parity["cause"]), parity["message"]
    assert "experts_scaled" == (parity.get("diagnosis") or {}).get("signature"), parity["message"]


def test_a_pipeline_runs_across_two_agents_with_pp_between_them(tmp_path: Path) -> None:
    """``--mesh dp=2,pp=2 --pp-schedule 1f1b`` on 2 agents x 2 workers: ranks 0-1 (one agent) hold stage 0 and ranks
    2-3 stage 1, so the pipeline's sends cross the agents. The pipeline recipe passes every check."""
    codes, text, report = job(tmp_path, "--recipe", "harness.recipes:pipeline_token_mean", "--precision", "fp32",
                              "--mesh", "dp=2,pp=2", "--pp-schedule", "1f1b")
    assert [0, 0] == codes, text[-3000:]
    assert report is not None and 0 == report["exit_status"]
    assert report["expected"] == report["run"] == report["counts"]["pass"] + report["counts"]["n/a"]
    assert {"pp=2,dp=2"} == {c["mesh"] for c in report["checks"]}, report["checks"][:1]


def test_a_count_over_dp_x_pp_fails_across_two_agents_under_an_interleaved_schedule(tmp_path: Path) -> None:
    """The count all-reduced over the whole world (dp x pp) where dp belongs, at ``dp=2,pp=2`` on 2 agents with
    ``interleaved1f1b`` (two stages per rank) and 2 schedule steps per window: parity fails on the numbers and the
    diagnosis names the group, as in-process."""
    codes, text, report = job(tmp_path, "--recipe", "harness.recipes:pp_count_over_world", "--precision", "fp32",
                              "--scenarios", "uneven", "--mesh", "dp=2,pp=2", "--pp-schedule", "interleaved1f1b",
                              "--pp-steps", "2")
    assert [1, 1] == codes, text[-3000:]
    assert report is not None
    parity = next(c for c in report["checks"] if c["check"] == "parity")
    assert ("fail", "numbers") == (parity["status"], parity["cause"]), parity["message"]
    assert "count_group" == parity["diagnosis"]["signature"], parity["message"]


@pytest.mark.parametrize(("mesh", "words"), [
    ("dp=2,cp=x", "--mesh='dp=2,cp=x': 'cp=x' is not NAME=SIZE"),
    ("dp=2,cp=2", "--mesh=dp=2,cp=2 has 4 ranks but torchrun started 2"),
], ids=["malformed", "other_world_size"])
def test_a_bad_mesh_exits_2_naming_it(tmp_path: Path, mesh: str, words: str) -> None:
    """The same error as the command line's and pytest's for a malformed shape; a shape of another world size than
    the job's names both."""
    _, text, report = job(tmp_path, "--recipe", "harness.recipes:mesh_token_mean", "--mesh", mesh, nodes=1)
    assert report is None
    assert words in text and "exitcode  : 2" in text, text[-3000:]


def test_keep_going_goes_past_runs_where_every_rank_raised_and_says_each_print_once(tmp_path: Path) -> None:
    """Every rank raises the same exception: with --battery-keep-going both runs are judged, the exception is said
    once with its count, and the recipe's print once with its ranks (not four workers' copies per run)."""
    codes, text, report = job(tmp_path, "--recipe", "user_recipes.failfast:WrongIgnoreIndex", "--precision", "fp32",
                              "--scenarios", "uneven,single", "--battery-keep-going", "--battery-deadline", "10")
    assert all(c == 1 for c in codes), text[-3000:]
    assert report is not None and {"crash"} == {c["cause"] for c in report["checks"] if c["status"] == "fail"}
    assert "the recipe raised in 2 cases (W=4; scenarios uneven,single; 12 verdicts):" in text, text[-3000:]
    assert "[printed by 8 ranks in 2 launches] hello from my step" in text
    assert 1 == text.count("hello from my step"), text[-3000:]
