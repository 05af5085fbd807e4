"""Resume verdicts on real ranks that never blame a correct loop: a fresh DDP wrapper sums like an old one at three
ranks, correct loops pass at three and four ranks while wrong ones fail, a DCP save with ``overwrite=False`` and a
DataLoader with workers pass the kills, a refusal is one usage error, and the commit machinery's own mistakes are
rejected. tests/unit/test_resume_verdicts.py checks the same verdicts without ranks."""

from __future__ import annotations

import json

import pytest
from support.resume_bodies import rewrap_gap

from harness.distributed.launcher import launch
from harness.resume.battery import run_battery
from harness.resume.commit_controls import CAUGHT_BY
from harness.resume.contract import HARNESS_TRAINER
from harness.resume.options import ResumeOptions
from harness.training.resume_controls import CONTROLS

SMALL = {"steps": 16, "every": 5}

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize(("frozen", "gap"), [(True, 0.0), (False, None)], ids=["frozen", "rebuilt"])
def test_a_fresh_ddp_wrapper_at_three_ranks_sums_like_the_old_one_once_its_buckets_are_frozen(
    frozen: bool, gap: float | None
) -> None:
    """A model re-wrapped at step 13 of 20 ends on the same bits with the battery's frozen buckets; with DDP's rebuild
    (the control) it does not: the cause the battery removes."""
    got = launch(rewrap_gap, 3, frozen, deadline=120)
    if gap is not None:
        assert [gap] * 3 == list(got)
    else:
        assert all(g > 0.0 for g in got), got


def test_the_harness_trainer_resumes_from_the_complete_checkpoint_after_a_kill_inside_its_save() -> None:
    """SIGKILL inside a save, then a resume through the one discovery, which skips the half-written newest folder:
    every state equal (the default tier's run of the battery on the harness's trainer; its controls, Python's and
    numpy's generators not restored and checkpoints labelled from 0, fail the same case in test_resume_battery.py)."""
    report = run_battery(HARNESS_TRAINER, ResumeOptions(**SMALL, cases=("kill-in-save",)))
    assert report.passed, report.table()
    assert ["repeatable", "kill-in-save"] == [r.case for r in report.results]
    kill = report.plan.kills["in-save"]
    assert f"skipping step-{kill.step:04d} (incomplete)" in report.results[1].message, report.table()


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("trainer", [HARNESS_TRAINER, "harness.resume.examples.plain:build"],
                         ids=["harness-trainer", "plain"])
def test_a_correct_ddp_loop_passes_a_stop_and_a_kill_at_three_and_four_ranks(trainer: str, world: int) -> None:
    """The reduction order of a fresh wrapper no longer reads as a resume bug at W >= 3."""
    report = run_battery(trainer, ResumeOptions(**SMALL, world_size=world, cases=("stop-resume", "kill-in-step")))
    assert report.passed, report.table()


@pytest.mark.slow
def test_a_wrong_loop_still_fails_at_three_ranks_naming_every_generator_it_forgets() -> None:
    """Negative control of the previous test: Python's and numpy's generators not restored, named on every rank."""
    report = run_battery(CONTROLS["python_numpy_rng"], ResumeOptions(**SMALL, world_size=3, cases=("stop-resume",)))
    (failure,) = report.failures()
    for rank in range(3):
        assert f"rank {rank}: the global generator ['python']" in failure.message, failure.message
    assert "the global generator ['numpy']" in failure.message


@pytest.mark.slow
def test_a_loop_with_dataloader_workers_and_a_dcp_save_that_will_not_overwrite_passes_every_kill() -> None:
    """examples/loader.py (two workers per rank, ``overwrite=False``, ``mkdir()`` without ``exist_ok``, numpy state)
    at three ranks: the folder a resumed save gets is empty even where a killed attempt wrote first."""
    report = run_battery("harness.resume.examples.loader:build", ResumeOptions(
        **SMALL, world_size=3, cases=("kill-in-save", "kill-before-commit")))
    assert report.passed, report.table()


def test_a_trainer_that_refuses_the_world_size_is_one_usage_error() -> None:
    """The harness's trainer on a two-rank config file, asked for three ranks: one usage error, no case run."""
    report = run_battery("support.resume_bodies:refuses_three_ranks", ResumeOptions(**SMALL, world_size=3))
    assert [] == report.results
    assert "world_size=3 (ranks started) differs from config world_size=2" in (report.usage_error or "")


def test_an_object_in_state_is_a_usage_error_naming_its_key() -> None:
    """A value the comparison cannot judge is refused before the first step, with its key."""
    report = run_battery("support.resume_bodies:object_in_state", ResumeOptions(**SMALL, cases=("stop-resume",)))
    assert "state()['sampler'] is a builtins.object" in (report.usage_error or ""), report.table()


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(CAUGHT_BY))
def test_a_mistake_in_the_commit_machinery_fails_the_case_that_interrupts_it(bug: str) -> None:
    """Files written in place (a kill inside the manifest's write leaves half of it), a discovery that trusts the
    newest folder (a kill inside the save leaves it half-written): the case fails; the harness's own commit passes
    the same cases (the default tier's battery above, and test_resume_battery.py)."""
    options = ResumeOptions(**SMALL, cases=CAUGHT_BY[bug])
    report = run_battery(HARNESS_TRAINER, options, commit_bug=bug)
    assert {r.case for r in report.failures()} == set(CAUGHT_BY[bug]), report.table()


@pytest.mark.slow
def test_a_case_whose_resumed_run_crashes_fails_naming_the_exception_and_the_battery_goes_on() -> None:
    """A save that raises OSError after a resume: both resumed cases fail with the rank and the exception named,
    ``repeatable`` still passes, and the report's JSON holds every case."""
    report = run_battery("support.resume_bodies:crashes_after_a_resume",
                         ResumeOptions(**SMALL, cases=("stop-resume", "kill-after-commit")))
    status = {r.case: r for r in report.results}
    assert ["repeatable", "stop-resume", "kill-after-commit"] == list(status)
    assert status["repeatable"].passed
    for case in ("stop-resume", "kill-after-commit"):
        assert "raised OSError: [Errno 28] No space left on device" in status[case].message, report.table()
    assert 3 == len(json.loads(json.dumps(report.to_dict()))["cases"])
