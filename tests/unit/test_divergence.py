"""The launcher names the rank that left its peers' collectives from what each rank reported per step
(:mod:`harness.distributed.divergence`), and names nobody where the records cannot tell."""

from __future__ import annotations

from harness.distributed.divergence import StepReport, first_divergence, ranks_phrase

DONE = StepReport("finished window {} with 1 gradient synchronization", 1)


def _done(step: int) -> StepReport:
    return StepReport(DONE.note.format(step), 1)


def test_a_rank_that_finished_a_step_with_no_collective_while_its_peers_never_did_is_named() -> None:
    """Rank 1 skipped the backward of window 3; ranks 0 and 2 wait in the synchronization it skipped."""
    history = {r: {s: _done(s) for s in range(3)} for r in range(3)}
    history[1][3] = StepReport("skipped the backward of window 3 (no gradient synchronization)", 0)
    found = first_divergence(history, 3)
    assert found is not None
    assert [1] == found[0]
    assert found[1].startswith("rank 1 skipped the backward of window 3 (no gradient synchronization): every rank "
                               "must run the same collectives (ranks 0 and 2 never finished it")


def test_ranks_that_finished_a_step_with_different_counts_name_the_rarer_count() -> None:
    """Rank 2 synchronized twice where its peers synchronized once."""
    history = {0: {0: _done(0)}, 1: {0: _done(0)}, 2: {0: StepReport("finished window 0 with 2 syncs", 2)}}
    found = first_divergence(history, 3)
    assert found is not None and [2] == found[0]
    assert "rank 2 finished window 0 with 2 syncs: every rank must run the same collectives (ranks 0 and 1 " in found[1]


def test_a_tie_between_counts_names_the_smaller_one() -> None:
    """At two ranks, 0 against 1: the rank that ran fewer skipped (commoner than a rank adding one)."""
    history = {0: {0: _done(0)}, 1: {0: StepReport("skipped the backward of window 0", 0)}}
    found = first_divergence(history, 2)
    assert found is not None and [1] == found[0]


def test_a_peer_stuck_after_ranks_that_ran_their_collectives_names_nobody() -> None:
    """The control: rank 1 crashed (or is stuck) in window 1 after rank 0 synchronized there; nothing says rank 0 left
    a collective, so nobody is named (the crash is the cause, and its traceback says so)."""
    history = {0: {0: _done(0), 1: _done(1)}, 1: {0: _done(0)}}
    assert first_divergence(history, 2) is None


def test_ranks_that_agree_or_did_not_count_name_nobody() -> None:
    """Equal counts everywhere, or notes without counts (a launcher caller that does not count): nothing to name."""
    assert first_divergence({r: {0: _done(0), 1: _done(1)} for r in range(2)}, 2) is None
    assert first_divergence({0: {0: StepReport("window 0", None)}, 1: {}}, 2) is None


def test_ranks_are_phrased_as_a_reader_writes_them() -> None:
    assert ("rank 1", "ranks 0 and 2", "ranks 0, 2 and 3") == (
        ranks_phrase([1]), ranks_phrase([2, 0]), ranks_phrase([0, 2, 3]))
