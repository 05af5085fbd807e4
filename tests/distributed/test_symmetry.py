"""Rank symmetry around collectives (seeds 003, 004): a skip decision every rank agrees on, each way a skipped
collective shows (a hang, a size mismatch, silently paired collectives), and windows with different microbatch counts
per rank through ``Join``.

``test_launcher.py`` already shows that a bare skipped all-reduce is reported at the process-group timeout; here the
skipped collective is DDP's own gradient all-reduce, and the variants that do *not* hang are covered too.
"""

from __future__ import annotations

import pytest
from support import symmetry

from harness.battery.judge import checks
from harness.battery.judge.verdict import Verdict
from harness.battery.launch import runner
from harness.data.batching import collate
from harness.data.corpus import Row
from harness.distributed.launcher import LaunchError, launch

# --- The agreed skip decision -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("losses", "skip"),
    [((0.42, 3.9), True), ((0.42, 0.5), False), ((0.1, 0.2, 2.5), True)],
    ids=["seed004-rank1-diverges", "no-rank-diverges", "world3-last-rank-diverges"],
)
def test_the_all_reduce_max_decision_is_the_same_on_every_rank(losses: tuple[float, ...], skip: bool) -> None:
    """Seed 004: every rank compares the all-reduced MAX with the threshold, so all skip or none does, and the
    gradients stay identical on every rank."""
    results = launch(symmetry.skip_step_body, len(losses), list(losses), 2.0)
    assert [skip] * len(losses) == [r["skip"] for r in results]
    assert [True] * len(losses) == [r["ranks_agree"] for r in results]


def test_a_decision_from_the_local_loss_leaves_a_rank_stuck_and_is_reported() -> None:
    """Negative control: rank 1 skips on its own loss, rank 0 waits in DDP's all-reduce; the run fails within the
    deadline naming rank 0 and the body it was stuck in, instead of hanging the suite."""
    with pytest.raises(LaunchError) as info:
        launch(symmetry.skip_step_body, 2, [0.42, 3.9], 2.0, False, deadline=3)
    err = info.value
    # Which rank's timeout fires first is a race: rank 0 waits in DDP's all-reduce, rank 1 in the checksum
    # all-gather; either way both are named, one with its traceback and the other with its stack.
    assert err.kind in ("raised", "died"), str(err)
    assert {0, 1} == set(err.ranks), str(err)
    assert any("skip_step_body" in d for d in err.details.values()), str(err)


# --- The three ways a skipped collective shows ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", (pytest.param("hang", marks=pytest.mark.slow), "mismatch"))
def test_a_skipped_backward_that_blocks_is_reported_with_the_ranks_named(mode: str) -> None:
    """Rank 1 skips its backward. ``hang``: rank 0 waits in the gradient all-reduce until the process-group timeout
    (below the deadline) raises, with rank 0's traceback. ``mismatch``: rank 1's next collective has another size;
    gloo aborts. Either way the launcher stops every rank and names them, with where each was."""
    with pytest.raises(LaunchError) as info:
        launch(symmetry.skipped_backward_body, 2, 1, mode, deadline=3)
    err = info.value
    assert err.kind in ("raised", "died"), str(err)  # found by the timeout or the abort, not by the deadline
    # Which rank gives up first is a race (the timeouts are equal), so the checks accept either order.
    if mode == "hang":
        assert 0 in err.ranks, str(err)
        assert any("skipped_backward_body" in d and "backward" in d for d in err.details.values()), str(err)
    else:
        # gloo's size check aborts the skipping rank (SIGABRT); its peer, if still running, is named with its stack.
        assert 1 == err.ranks[0], str(err)


def test_a_skipped_backward_silently_paired_with_a_same_size_collective_is_found_by_the_checksum() -> None:
    """Rank 1 skips its backward and all-reduces a tensor the size of the gradient bucket: gloo pairs it with rank
    0's gradient all-reduce. No error, no hang; only the checksum all-gather shows the ranks disagree."""
    results = launch(symmetry.skipped_backward_body, 2, 1, "paired")
    assert [False, False] == [r["ranks_agree"] for r in results]


def test_the_checksum_finds_nothing_when_every_rank_runs_its_backward() -> None:
    """Negative control for the checksum: a symmetric step (no rank skips) reports agreement on every rank."""
    results = launch(symmetry.skip_step_body, 2, [0.1, 0.2], 2.0)
    assert [True, True] == [r["ranks_agree"] for r in results]


# --- Join: different numbers of microbatches per rank ---------------------------------------------------------------


def _rows(n: int, length: int, prompt: int = 0, offset: int = 0) -> list[Row]:
    return [Row(i, "train", tuple(1 + (offset + 3 * i + 2 * t) % 31 for t in range(length)), prompt) for i in range(n)]


UNEVEN_MICROBATCHES = {
    # rank r's microbatches; rank 0 runs out first and joins while the others go on.
    "world2-1-vs-3": [
        [collate(_rows(2, 9))],
        [collate(_rows(1, 5, offset=1)), collate(_rows(2, 12, 3, offset=2)), collate(_rows(1, 7, offset=3))],
    ],
    "world3-1-2-3": [
        [collate(_rows(1, 11, 2))],
        [collate(_rows(2, 6, offset=4)), collate(_rows(1, 10, offset=5))],
        [collate(_rows(1, 4, offset=6)), collate(_rows(2, 8, 8, offset=7)), collate(_rows(1, 12, offset=8))],
    ],
}


@pytest.fixture(params=sorted(UNEVEN_MICROBATCHES), ids=str)
def uneven_microbatches(request: pytest.FixtureRequest) -> list:
    return [UNEVEN_MICROBATCHES[request.param]]


def _join_parity(recipe: str, windows: list) -> Verdict:
    return checks.parity(runner.run_windows(f"support.symmetry:{recipe}", windows, deadline=10))


def test_join_with_the_count_taken_before_it_keeps_the_global_token_mean(uneven_microbatches: list) -> None:
    """Each rank backpropagates ``W * S_mb / N`` per microbatch, N all-reduced before the join; joined ranks add
    zeros to an all-reduce that still divides by W, so every rank's gradient is the single-device reference."""
    verdict = _join_parity("join_token_mean", uneven_microbatches)
    assert verdict.passed, verdict.message


@pytest.mark.parametrize(
    "control",
    ("join_accumulating_in_grad", "join_without_broadcast", "join_local_means", "join_logged_loss_inside"),
)
def test_join_mistakes_miss_the_reference(control: str, uneven_microbatches: list) -> None:
    """Negative controls: accumulating in ``.grad`` (a joined rank's zeros shrink the earlier microbatches), no
    broadcast from the last joiner (the early joiner keeps a partial sum), per-microbatch means (weights microbatches,
    divided by the initial W), and an own all-reduce inside the join (nothing shadows it: the run breaks)."""
    verdict = _join_parity(control, uneven_microbatches)
    assert not verdict.passed
    assert "check parity FAILED" in verdict.message
