"""The launcher itself: results and tracebacks come back, and every failure mode ends the run promptly with the rank
named and no process left behind."""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from support import probes

from harness.distributed import scratch
from harness.distributed.launcher import Expected, LaunchError, launch, progress
from harness.distributed.probes import all_reduce_rank

HERE = Path(__file__).parent
TESTS = HERE.parent


@pytest.fixture
def bodies(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``launcher_bodies``, imported by plain name from this folder (each rank inherits the caller's sys.path)."""
    monkeypatch.syspath_prepend(str(HERE))
    return importlib.import_module("launcher_bodies")


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
    assert [world_size * (world_size + 1) // 2] * world_size == launch(all_reduce_rank, world_size)


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
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from support import probes
        from harness.distributed.launcher import launch
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
        # Its launch folder is named after it; it outlives it (its `finally` never runs) until the next launch of any
        # process removes it.
        left = f"{scratch.PREFIX}{parent.pid}-"
        assert any(n.startswith(left) for n in os.listdir(tempfile.gettempdir()))
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert [] == _wait_gone(pids, within=10)
        launch(probes.identity, 1, None)
        assert not any(n.startswith(left) for n in os.listdir(tempfile.gettempdir()))
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_two_runs_at_once_do_not_collide() -> None:
    """Concurrent launches rendezvous in their own temporary folders: no shared port or file."""
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = launch(all_reduce_rank, 2)

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
        ({"env": {"HARNESS_FAULT": 1}}, TypeError, "env={'HARNESS_FAULT': 1}"),
        ({"lockstep_grace": 0}, ValueError, "lockstep_grace=0"),
        ({"lockstep_grace": "2"}, ValueError, "lockstep_grace='2'"),
        ({"preload": "numpy"}, TypeError, "preload='numpy'"),
        ({"preload": ("numpy", "not a module")}, ValueError, "'not a module', which is not a module name"),
        ({"nodes": 3}, ValueError, "nodes=3 must be a positive number of nodes that divides world_size=2"),
        ({"nodes": 0}, ValueError, "nodes=0"),
    ],
    ids=[
        "world0", "negative-deadline", "unknown-backend", "nccl-on-cpu", "unknown-device", "expect-not-tuple",
        "threads0", "env-not-str", "grace0", "grace-string", "preload-string", "preload-bad-name", "nodes-not-divisor",
        "nodes0",
    ],
)
def test_bad_arguments_are_refused_before_any_rank_starts(kwargs: dict, error: type, names: str) -> None:
    """Each invalid argument is named in the error, with the expected form."""
    args = {"world_size": 2, **kwargs}
    world = args.pop("world_size")
    with pytest.raises(error, match=names.replace("(", r"\(")):
        launch(probes.identity, world, None, **args)


# --- lockstep progress -----------------------------------------------------------------------------------------------
# The deadline in these tests is far longer than the grace, and the process-group timeout (0.75 x deadline) longer
# still: a run that is stopped as "desync" was stopped by the lockstep check, not by a timeout.


def test_an_expected_exception_on_one_rank_is_a_desync_not_a_timeout() -> None:
    """Rank 0 raises the expected ValueError while rank 1 enters an all-reduce: the run stops as "desync", naming
    rank 1 with where it was stuck and what rank 0 did."""
    with pytest.raises(LaunchError) as info:
        launch(probes.raise_on, 2, 0, "ValueError", "no supervised token", expect=(ValueError,), deadline=60,
               lockstep_grace=2)
    err = info.value
    assert "desync" == err.kind
    assert (1,) == err.ranks
    assert 0 == err.leader
    assert "rank 0 ended its function (raised ValueError: no supervised token) but rank(s) [1] did not within 2 s" in (
        str(err))
    assert "all_reduce" in err.details[1]
    assert "raise_on" in err.details[1]
    assert "no step reported" in err.details[1]


def test_ranks_in_lockstep_pass(bodies: ModuleType) -> None:
    """Ranks that report every step, one collective per step, finish normally under a lockstep grace."""
    steps = 5
    results = launch(bodies.lockstep, 2, steps, deadline=60, lockstep_grace=2)
    assert [[1 + 2 * s for s in range(steps)]] * 2 == results


def test_a_rank_that_returns_early_is_a_desync_naming_its_peers_stack() -> None:
    """Rank 1 returns without the all-reduce rank 0 waits in: rank 0 is named, with its stack in the all-reduce."""
    with pytest.raises(LaunchError) as info:
        launch(probes.skip_collective_on, 2, 1, deadline=60, lockstep_grace=2)
    err = info.value
    assert "desync" == err.kind
    assert (0,) == err.ranks
    assert 1 == err.leader
    assert "rank 1 ended its function (returned) but rank(s) [0] did not within 2 s" in str(err)
    assert "all_reduce" in err.details[0]
    assert "skip_collective_on" in err.details[0]


def test_a_desync_names_the_first_step_the_ranks_disagree_on_with_the_leaders_note(bodies: ModuleType) -> None:
    """Rank 0 refuses window 2 and says so; rank 1, stuck in window 2's all-reduce, last reported window 1. With
    three ranks, both peers left behind are named."""
    with pytest.raises(LaunchError) as info:
        launch(bodies.refuse_on, 3, 0, 2, 4, deadline=60, lockstep_grace=2)
    err = info.value
    assert "desync" == err.kind
    assert (1, 2) == err.ranks
    assert ("rank 0 finished step 2 (window 2: refused the window: ValueError: no supervised token) but rank(s) "
            "[1, 2] did not within 2 s; every rank was stopped") in str(err)
    for rank in (1, 2):
        assert "last reported step 1 (window 1)" in err.details[rank]
        assert "refuse_on" in err.details[rank]


@pytest.mark.slow
def test_the_deadline_still_holds_while_ranks_keep_in_step(bodies: ModuleType) -> None:
    """Ranks that keep reporting steps in lockstep but never finish are still stopped at the deadline."""
    with pytest.raises(LaunchError) as info:
        launch(bodies.tick, 2, None, 0.05, deadline=3, lockstep_grace=1)
    assert "deadline" == info.value.kind
    assert (0, 1) == info.value.ranks
    assert "last reported step" in info.value.details[0]


def test_many_notices_never_stall_a_rank(bodies: ModuleType) -> None:
    """A rank may report far more steps than the pipe holds at once: notices the pipe cannot take now are folded
    into the next one, and the run ends normally."""
    assert [20_000, 20_000] == launch(bodies.tick, 2, 20_000, 0.0, lockstep_grace=5)


def test_progress_outside_a_launched_rank_does_nothing_but_checks_its_arguments() -> None:
    progress(0, "not in a rank")
    with pytest.raises(ValueError, match="step=-1"):
        progress(-1)
    with pytest.raises(ValueError, match="step=True"):
        progress(True)
    with pytest.raises(TypeError, match="note=3"):
        progress(0, 3)  # type: ignore[arg-type]


# --- start-up --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_rank_late_to_start_is_not_failed_by_the_process_group_timeout(bodies: ModuleType) -> None:
    """Rank 1 starts 8.5 s after rank 0. The process-group timeout for deadline=10 is 7.5 s: it applies from the
    first barrier on, while the rendezvous before it may take up to the deadline. (With the process-group timeout
    bounding the rendezvous too, this run failed in gloo's connectFullMesh.)"""
    late = bodies.LateArrival(1, 8.5)
    results = launch(probes.identity, 2, late, deadline=10)
    assert ["on time", "late"] == [r["value"] for r in results]


@pytest.mark.slow
def test_a_slow_start_leaves_the_collectives_less_time_not_the_deadline(bodies: ModuleType) -> None:
    """Rank 1 starts 2 s late, then rank 0 waits alone in an all-reduce. For deadline=5 the process-group timeout is
    3.75 s, which from a start at 2 s would end past the deadline (a kill, without a traceback); each rank cuts it to
    what start-up left (about 1.9 s), so the stuck collective raises in time and the run says where it was."""
    late = bodies.LateArrival(1, 2.0)
    with pytest.raises(LaunchError) as info:
        launch(bodies.late_then_refuse, 2, late, 1, 0, 1, deadline=5)
    assert "raised" == info.value.kind, str(info.value)


# --- the caller's environment ----------------------------------------------------------------------------------------


def test_ranks_see_the_callers_environment_as_of_each_launch(bodies: ModuleType,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable set after a first launch reaches the ranks of the next; one deleted in the caller is gone in the
    rank even though the forkserver started with it; every other variable is the caller's."""
    name = f"HARNESS_TEST_SET_LATER_{os.getpid()}"
    monkeypatch.delenv(name, raising=False)
    first = launch(bodies.environment, 2)
    assert all(name not in r["environ"] for r in first)
    # A variable the running forkserver was started with (so its ranks would inherit it) that the caller has too.
    candidates = [k for k in first[0]["server"] if k in os.environ and not k.startswith(("PATH", "LD_", "PYTHON"))]
    assert candidates, "the forkserver's environment shares no variable with the caller's"
    gone = candidates[0]
    monkeypatch.setenv(name, "set after the first launch")
    monkeypatch.delenv(gone)
    second = launch(bodies.environment, 2, env={"HARNESS_TEST_EXTRA": "from env="})
    for rank, result in enumerate(second):
        expected = {
            **os.environ, "HARNESS_TEST_EXTRA": "from env=", "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        }
        assert "set after the first launch" == result["environ"][name]
        assert gone not in result["environ"]
        assert expected == result["environ"]


def test_ranks_over_nodes_see_torchruns_node_variables(bodies: ModuleType) -> None:
    """nodes=2 at W=4: two nodes of two consecutive ranks, as torchrun sets them (the default is one node)."""
    got = [r["environ"] for r in launch(bodies.environment, 4, nodes=2)]
    assert [("4", "2", str(r % 2), str(r // 2)) for r in range(4)] == [
        (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in got]


# --- preloading the caller's modules ---------------------------------------------------------------------------------

_RECORDER = """
import os

IMPORTED_IN = os.getpid()


def where():
    return {"imported_in": IMPORTED_IN, "pid": os.getpid(), "parent": os.getppid()}
"""


@pytest.mark.slow
def test_a_preloaded_module_is_imported_by_the_forkserver_before_it_forks(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Without preload, each rank imports the module of its function itself; with it, the forkserver (each rank's
    parent) imported it once, before forking. A module that raises at import does not break the server."""
    tag = f"{os.getpid()}_{time.monotonic_ns()}"
    plain, preloaded, broken = f"plain_{tag}", f"preloaded_{tag}", f"broken_{tag}"
    (tmp_path / f"{plain}.py").write_text(_RECORDER)
    (tmp_path / f"{preloaded}.py").write_text(_RECORDER)
    (tmp_path / f"{broken}.py").write_text("raise RuntimeError('this module cannot be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    for r in launch(importlib.import_module(plain).where, 2):
        assert r["imported_in"] == r["pid"]

    results = launch(importlib.import_module(preloaded).where, 2, preload=(preloaded, broken))
    for r in results:
        assert r["imported_in"] != r["pid"]
        assert r["imported_in"] == r["parent"]
    assert results[0]["imported_in"] != os.getpid()
    # The server keeps the module for later launches that do not ask for it.
    assert results[0]["imported_in"] == launch(importlib.import_module(preloaded).where, 2)[0]["imported_in"]


@pytest.mark.slow
def test_a_module_that_imports_the_launcher_is_preloaded_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that imports the launcher at its top (as the battery's rank program does) is imported by the
    forkserver before it forks, not by each rank: the server imports the caller's modules once the launcher is
    whole."""
    name = f"imports_launcher_{os.getpid()}_{time.monotonic_ns()}"
    (tmp_path / f"{name}.py").write_text("from harness.distributed.launcher import LaunchError, launch\n" + _RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    for r in launch(importlib.import_module(name).where, 2, preload=(name,)):
        assert r["imported_in"] == r["parent"] != r["pid"]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_launch_removes_the_folders_of_dead_callers_and_keeps_live_ones() -> None:
    """A folder named after a process that has ended (a caller SIGKILLed mid-launch) is removed by the next launch;
    one of a live process, or one without a pid in its name, is left alone."""
    root = tempfile.gettempdir()
    dead = _dead_pid()
    assert not scratch.pid_alive(dead)
    stale = Path(tempfile.mkdtemp(prefix=f"{scratch.PREFIX}{dead}-", dir=root))
    (stale / "stack-0.txt").write_text("left behind")
    live = Path(tempfile.mkdtemp(prefix=f"{scratch.PREFIX}{os.getpid()}-", dir=root))
    foreign = Path(tempfile.mkdtemp(prefix=f"{scratch.PREFIX}nopid-", dir=root))
    try:
        assert 0 == launch(probes.identity, 1, 0)[0]["value"]
        assert not stale.exists()
        assert live.is_dir() and foreign.is_dir()
    finally:
        for path in (stale, live, foreign):
            shutil.rmtree(path, ignore_errors=True)



# --- what the ranks print ---------------------------------------------------------------------------------------------


def _relayed(text: str, needle: str) -> list[str]:
    return [ln for ln in text.splitlines() if needle in ln]


def test_a_warning_raised_on_every_rank_is_printed_once_naming_the_ranks(
    bodies: ModuleType, capfd: pytest.CaptureFixture[str]
) -> None:
    """warnings.warn on both ranks: one line on the caller's stderr, prefixed [ranks 0,1], instead of two copies."""
    assert [0, 1] == launch(bodies.warn, 2, "x is deprecated; use y")
    lines = _relayed(capfd.readouterr().err, "UserWarning: x is deprecated; use y")
    assert 1 == len(lines), lines
    assert lines[0].startswith("[ranks 0,1] ")


def test_a_write_below_python_to_a_file_descriptor_is_captured_too(
    bodies: ModuleType, capfd: pytest.CaptureFixture[str]
) -> None:
    """os.write(2, ...) (what C++ code such as gloo does) is caught at the descriptor; one rank's line names it."""
    launch(bodies.write_fd, 2, 2, "written below Python\n")
    err = capfd.readouterr().err
    assert ["[ranks 0,1] written below Python"] == _relayed(err, "written below Python")
    assert ["[rank 1] only rank 1 says this"] == _relayed(err, "only rank 1 says this")


def test_the_output_of_a_rank_that_crashed_is_relayed_and_its_traceback_kept(
    bodies: ModuleType, capfd: pytest.CaptureFixture[str]
) -> None:
    """A failed launch relays what the ranks printed before it failed; the error still carries the traceback."""
    with pytest.raises(LaunchError) as info:
        launch(bodies.print_then_raise, 2, "about to train", deadline=30)
    assert ["[ranks 0,1] about to train"] == _relayed(capfd.readouterr().err, "about to train")
    assert "RuntimeError: rank 1 gave up after printing" in info.value.details[1]
    assert "about to train\n" == info.value.output[1]


def test_without_relay_nothing_is_printed_and_each_ranks_text_comes_back(
    bodies: ModuleType, capfd: pytest.CaptureFixture[str]
) -> None:
    """relay_output=False: the caller's stderr stays empty; .output holds every rank's own, unmerged text."""
    results = launch(bodies.write_fd, 2, 1, "to stdout\n", relay_output=False)
    assert [0, 1] == results
    assert "" == capfd.readouterr().err
    assert {0: "to stdout\n", 1: "to stdout\nonly rank 1 says this\n"} == results.output


def test_a_rank_aborted_by_gloo_is_reported_with_its_last_output(bodies: ModuleType) -> None:
    """A collective mismatch aborts a rank from C++: its death comes with gloo's words, which only its stderr has."""
    with pytest.raises(LaunchError) as info:
        launch(bodies.mismatched_all_reduce, 2, deadline=30)
    err = info.value
    assert "died" == err.kind
    dead = err.ranks[0]
    assert "(its last output:)" in err.details[dead]
    assert "collective mismatch" in err.details[dead]


def test_a_rank_that_skipped_a_collective_inside_a_step_is_named_before_the_abort(bodies: ModuleType) -> None:
    """No rank finishes step 0: gloo aborts the run in the all-reduce, and the ranks' reports from inside the step
    name rank 1, which began no synchronization where rank 0 began one; gloo's words follow the cause."""
    with pytest.raises(LaunchError) as info:
        launch(bodies.report_inside_then_mismatch, 2, 1, True, deadline=30)
    err = info.value
    assert "desync" == err.kind and 1 == err.ranks[0]
    assert err.cause is not None
    assert err.cause.startswith("rank 1 skipped the backward of window 0 (microbatch 1): its DDP all-reduce never "
                                "ran, so the collective rank 0 was in met another one or none"), err.cause
    assert str(err).startswith(err.cause) and "collective mismatch" in str(err)


def test_a_rank_whose_step_ended_in_its_own_exception_is_not_named_as_having_skipped(bodies: ModuleType) -> None:
    """The control: the same abort, rank 1's report from inside the step carrying no count (its own exception): no
    rank is named, and the run stays the death gloo caused."""
    with pytest.raises(LaunchError) as info:
        launch(bodies.report_inside_then_mismatch, 2, 1, False, deadline=30)
    assert "died" == info.value.kind and info.value.cause is None
