"""The launcher itself: results and tracebacks come back, and every failure mode ends the run promptly with the rank
named and no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from harness import probes
from harness.launcher import Expected, LaunchError, launch


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has ended all the same.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], within: float) -> list[int]:
    end = time.monotonic() + within
    while time.monotonic() < end:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("world_size", (1, 2, 3), ids=lambda w: f"world{w}")
def test_each_rank_returns_its_own_value(world_size: int) -> None:
    """Every rank runs inside a process group of the requested size and its return value reaches the parent."""
    results = launch(probes.identity, world_size, "payload")
    assert [{"rank": r, "world_size": world_size, "value": "payload"} for r in range(world_size)] == [
        {k: v for k, v in res.items() if k != "pid"} for res in results
    ]
    assert len({res["pid"] for res in results}) == world_size


@pytest.mark.parametrize("world_size", (2, 3), ids=lambda w: f"world{w}")
def test_collectives_reach_every_rank(world_size: int) -> None:
    """An all-reduce over the launched group sums every rank's contribution."""
    assert [world_size * (world_size + 1) // 2] * world_size == launch(probes.all_reduce_rank, world_size)


def test_a_ddp_step_runs_and_tensors_come_back_by_value() -> None:
    """A DDP step runs on two ranks; both see the same synchronized gradient."""
    first, second = launch(probes.ddp_step, 2)
    assert first == second


def test_a_raising_rank_fails_the_run_with_its_traceback() -> None:
    """A rank that raises stops the run at once (not at the deadline); the error names it and carries its traceback."""
    with pytest.raises(LaunchError) as info:
        launch(probes.raise_on, 2, 1, "RuntimeError", "boom from the probe", deadline=30)
    err = info.value
    assert "raised" == err.kind
    assert 1 == err.ranks[0]
    assert "RuntimeError: boom from the probe" in err.details[1]
    assert "rank 1 of 2 raised" in str(err)


def test_a_raising_rank_reports_where_its_peers_were_stuck() -> None:
    """The peers left waiting in the collective are reported with their Python stacks."""
    with pytest.raises(LaunchError) as info:
        launch(probes.raise_on, 2, 1, deadline=30)
    assert (1, 0) == info.value.ranks
    assert "all_reduce" in info.value.details[0]


def test_an_expected_exception_comes_back_as_a_value_on_every_rank() -> None:
    """With expect=(ValueError,), "every rank raised ValueError" is an observable result, not a failure."""
    results = launch(probes.raise_on, 1, 0, "ValueError", "no supervised token", expect=(ValueError,))
    assert [Expected("ValueError", "no supervised token")] == results


def test_an_unexpected_exception_type_still_fails_the_run() -> None:
    """expect only covers the listed types."""
    with pytest.raises(LaunchError, match="RuntimeError"):
        launch(probes.raise_on, 1, 0, "RuntimeError", expect=(ValueError,))


def test_a_rank_killed_by_sigkill_fails_the_run_at_once() -> None:
    """A rank that dies from a signal is reported by rank and signal; its peer blocked in a collective is killed."""
    with pytest.raises(LaunchError) as info:
        launch(probes.kill_self_on, 2, 0, deadline=30)
    assert "died" == info.value.kind
    assert 0 == info.value.ranks[0]
    assert "died from SIGKILL" in str(info.value)


def test_a_rank_stuck_in_a_collective_fails_within_the_deadline() -> None:
    """A rank that skips a collective leaves its peer waiting; the process-group timeout (set below the deadline)
    turns that into an error naming the stuck rank, before the deadline."""
    with pytest.raises(LaunchError) as info:
        launch(probes.skip_collective_on, 2, 1, deadline=4)
    assert "raised" == info.value.kind
    # Both ranks are stuck: rank 0 in the all-reduce, rank 1 at the end of the run waiting for rank 0. Whichever
    # times out first is reported with its traceback, the other with its stack.
    assert {0, 1} == set(info.value.ranks)
    assert "all_reduce" in info.value.details[0]


def test_the_deadline_kills_every_rank_and_reports_their_stacks(tmp_path: Path) -> None:
    """Ranks still running at the deadline are killed and named, each with the Python stack it was in."""
    pid_file = str(tmp_path / "pid")
    with pytest.raises(LaunchError) as info:
        launch(probes.sleep_on, 2, None, 3600.0, pid_file, deadline=2)
    assert "deadline" == info.value.kind
    assert (0, 1) == info.value.ranks
    for rank in (0, 1):
        assert "sleep_on" in info.value.details[rank]
    pids = [int(Path(f"{pid_file}.{r}").read_text()) for r in (0, 1)]
    assert [] == _wait_gone(pids, within=5)


def test_no_rank_outlives_a_successful_run(tmp_path: Path) -> None:
    """After a normal return every rank process has ended."""
    pid_file = str(tmp_path / "pid")
    launch(probes.sleep_on, 2, 0, 0.0, pid_file)
    pids = [int(Path(f"{pid_file}.{r}").read_text()) for r in (0, 1)]
    assert [] == _wait_gone(pids, within=5)


def test_no_rank_outlives_a_killed_parent(tmp_path: Path) -> None:
    """When the calling process is SIGKILLed mid-run, its ranks die with it instead of waiting out a timeout."""
    pid_file = tmp_path / "pid"
    script = textwrap.dedent(
        f"""
        from harness import probes
        from harness.launcher import launch
        launch(probes.sleep_on, 2, None, 3600.0, {str(pid_file)!r}, deadline=600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    try:
        end = time.monotonic() + 60
        while not all(Path(f"{pid_file}.{r}").exists() for r in (0, 1)):
            assert parent.poll() is None, "the launching process ended before its ranks started"
            assert time.monotonic() < end, "ranks did not start within 60 s"
            time.sleep(0.05)
        pids = [int(Path(f"{pid_file}.{r}").read_text()) for r in (0, 1)]
        assert all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert [] == _wait_gone(pids, within=10)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_two_runs_at_once_do_not_collide() -> None:
    """Concurrent launches rendezvous in their own temporary folders: no shared port or file."""
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = launch(probes.all_reduce_rank, 2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {0: [3, 3], 1: [3, 3], 2: [3, 3]} == results


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"world_size": 0}, ValueError, "world_size=0"),
        ({"deadline": -1}, ValueError, "deadline=-1"),
        ({"backend": "mpi"}, ValueError, "backend='mpi'"),
        ({"backend": "nccl"}, ValueError, "device='cuda'"),
        ({"device": "tpu"}, ValueError, "device='tpu'"),
        ({"expect": ValueError}, TypeError, "expect="),
        ({"threads": 0}, ValueError, "threads=0"),
    ],
    ids=[
        "world0", "negative-deadline", "unknown-backend", "nccl-on-cpu", "unknown-device", "expect-not-tuple",
        "threads0",
    ],
)
def test_bad_arguments_are_refused_before_any_rank_starts(kwargs: dict, error: type, names: str) -> None:
    """Each invalid argument is named in the error, with the expected form."""
    args = {"world_size": 2, **kwargs}
    world = args.pop("world_size")
    with pytest.raises(error, match=names.replace("(", r"\(")):
        launch(probes.identity, world, None, **args)
