"""Kill a rank with SIGKILL at a named point, resume from the latest complete checkpoint, land on the same bits.

A planned stop at 50 only proves resumption at a clean boundary. Real jobs die anywhere, also while a checkpoint is
being written: each case below kills one rank at one fault point (``HARNESS_FAULT``), checks that the launcher reports
that rank's death at once, that discovery skips the step directory the kill left incomplete, and that resuming from
the step it finds reaches step 100 with the continuous run's exact model, optimizer and scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.data.config import Config, load_config
from harness.distributed.launcher import LaunchError, launch
from harness.resume.checkpoint import MANIFEST, audit_run_dir, latest_checkpoint, step_dir_name
from harness.training.trainer import FAULT_ENV, FAULT_RECORD, launched_run, state_difference

MINIMUM = Path(__file__).resolve().parents[2] / "configs" / "minimum.yaml"
DEADLINE = 60.0


@dataclass(frozen=True)
class Kill:
    rank: int
    step: int
    point: str
    resumes_at: int
    """The latest complete checkpoint after the kill."""

    @property
    def env(self) -> dict[str, str]:
        return {FAULT_ENV: f"rank={self.rank},step={self.step},point={self.point}"}


KILLS = [
    Kill(rank=1, step=37, point="in-window", resumes_at=30),
    pytest.param(Kill(rank=1, step=40, point="after-rank-temp", resumes_at=30), marks=pytest.mark.slow),
    pytest.param(Kill(rank=0, step=40, point="after-rank-temp", resumes_at=30), marks=pytest.mark.slow),
    pytest.param(Kill(rank=0, step=40, point="before-manifest", resumes_at=30), marks=pytest.mark.slow),
    Kill(rank=1, step=40, point="after-manifest", resumes_at=40),
]
"""A kill inside a window and one after a complete checkpoint run in the test command; the kills between a rank's
temporary file and the manifest run in the slow tier."""

# The uninterrupted control run is a module fixture: one worker computes it once for every kill.
pytestmark = pytest.mark.xdist_group("kill-resume")


@pytest.fixture(scope="module")
def kill_config() -> Config:
    return load_config(MINIMUM)


@pytest.fixture(scope="module")
def continuous_for_kills(kill_config: Config, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The uninterrupted control run to step 100."""
    return launch(launched_run, 2, kill_config, str(tmp_path_factory.mktemp("continuous")), {}, deadline=DEADLINE)


"""How gloo reports, on a surviving rank, that a peer's process is gone."""


def _assert_death_reported(error: LaunchError, killed: int) -> None:
    """The launcher names the killed rank's death as the cause, not the survivor's "Connection closed by peer" (which
    the survivor's gloo call raises the instant the killed rank's sockets close), and stops the run at once."""
    assert "died" == error.kind, str(error)
    assert killed == error.ranks[0], str(error)
    assert f"rank {killed} of 2 died from SIGKILL" in str(error)


@pytest.mark.parametrize("kill", KILLS, ids=lambda k: f"{k.point}-rank{k.rank}-step{k.step}")
def test_a_killed_run_resumes_from_its_latest_complete_checkpoint_to_the_same_bits(
    kill: Kill, kill_config: Config, continuous_for_kills: list[dict], tmp_path: Path
) -> None:
    """SIGKILL at the fault point; the death is reported for that rank; the resume equals the continuous run at 100."""
    killed_dir, resumed_dir = tmp_path / "killed", tmp_path / "resumed"
    with pytest.raises(LaunchError) as caught:
        launch(launched_run, 2, kill_config, str(killed_dir), {}, deadline=DEADLINE, env=kill.env)
    assert (killed_dir / FAULT_RECORD).read_text() == f"rank={kill.rank},step={kill.step},point={kill.point}\n"
    _assert_death_reported(caught.value, kill.rank)

    latest = latest_checkpoint(killed_dir)
    assert latest is not None
    assert latest.name == step_dir_name(kill.resumes_at)
    if kill.resumes_at < kill.step and kill.point != "in-window":
        # The interrupted step directory exists, but without its manifest: discovery had to skip it.
        assert (killed_dir / step_dir_name(kill.step)).is_dir()
        assert not (killed_dir / step_dir_name(kill.step) / MANIFEST).exists()

    resumed = launch(launched_run, 2, kill_config, str(resumed_dir), {"resume": f"latest:{killed_dir}"},
                     deadline=DEADLINE)
    assert [s["start_step"] for s in resumed] == [kill.resumes_at] * 2
    for rank in range(2):
        got = state_difference(continuous_for_kills[rank]["state"], resumed[rank]["state"])
        assert got == 0.0, f"rank {rank}: step-100 state differs from the continuous run by {got}"
        assert continuous_for_kills[rank]["losses"] == resumed[rank]["losses"]


def test_a_rank_file_killed_before_its_rename_leaves_only_a_temporary_name(
    kill_config: Config, tmp_path: Path
) -> None:
    """After a kill between the temporary write and the rename, rank-1.pt is absent and a hidden temporary file holds
    the bytes: a reader never sees half a rank file under its final name."""
    kill = Kill(rank=1, step=20, point="after-rank-temp", resumes_at=10)
    with pytest.raises(LaunchError):
        launch(launched_run, 2, kill_config.replace(updates=30, stop_at=30), str(tmp_path), {}, deadline=DEADLINE,
               env=kill.env)
    folder = tmp_path / step_dir_name(20)
    names = {p.name for p in folder.iterdir()}
    assert "rank-1.pt" not in names
    temps = [n for n in names if n.startswith(".rank-1.pt.tmp-")]
    assert temps, names
    assert step_dir_name(10) == latest_checkpoint(tmp_path).name  # type: ignore[union-attr]
    # The audit names what the kill left: the step without manifest, and the temporary of the dead rank.
    problems = audit_run_dir(tmp_path)
    expected = [f"{folder}: incomplete checkpoint: ", f"{folder / temps[0]}: stale temporary file of rank-1.pt, "]
    assert 2 == len(problems), problems
    assert all(p.startswith(e) for p, e in zip(problems, expected)), problems


def test_a_fault_at_a_step_without_checkpoint_is_refused(kill_config: Config, tmp_path: Path) -> None:
    """A checkpoint fault point at a step that writes no checkpoint would never fire: every rank refuses it."""
    results = launch(launched_run, 2, kill_config, str(tmp_path), {}, deadline=DEADLINE, expect=(ValueError,),
                     env={FAULT_ENV: "rank=1,step=37,point=after-rank-temp"})
    assert all(r.type == "ValueError" and "step=37 writes no checkpoint" in r.message for r in results)
