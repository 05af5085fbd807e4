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


def _within(note: str, begun: int | None) -> StepReport:
    return StepReport(note, begun, finished=False)


SKIPPED = "skipped the backward of window 0 (microbatch 1): its DDP all-reduce never ran"
RAN = "ran the backward of window 0 (microbatch 1), which began the DDP all-reduce"


def test_a_rank_that_died_inside_a_step_after_skipping_its_synchronization_is_named_from_its_report_there() -> None:
    """No rank finished window 0 (gloo aborted the run inside it): rank 1 began no synchronization where ranks 0
    and 2 began one, and is named from what it reported inside the window."""
    working = {0: (0, _within(RAN, 1)), 1: (0, _within(SKIPPED, 0)), 2: (0, _within(RAN, 1))}
    found = first_divergence({0: {}, 1: {}, 2: {}}, 3, working)
    assert found is not None and [1] == found[0]
    assert found[1].startswith(f"rank 1 {SKIPPED}, so the collective ranks 0 and 2 were in met another one or none: "
                               "every rank must run the same collectives (ranks 0 and 2 ran the backward"), found[1]


def test_a_report_from_inside_a_step_is_compared_with_the_peers_that_finished_it() -> None:
    """Rank 0 finished window 1 with its synchronization; rank 1 was still in it having begun none: rank 1."""
    history = {0: {0: _done(0), 1: _done(1)}, 1: {0: _done(0)}}
    found = first_divergence(history, 2, {0: (2, _within(RAN, 0)), 1: (1, _within(SKIPPED, 0))})
    assert found is not None and [1] == found[0]


def test_a_rank_that_raised_in_its_own_code_inside_a_step_names_nobody() -> None:
    """The control: rank 1's window ended in its own exception (reported without a count), rank 0 began its
    synchronization: the exception is the cause, and no rank is named as having skipped anything."""
    working = {0: (0, _within(RAN, 1)), 1: (0, _within("raised KeyError in window 0", None))}
    assert first_divergence({0: {}, 1: {}}, 2, working) is None


def test_reports_from_inside_a_step_that_agree_or_miss_a_rank_name_nobody() -> None:
    """Equal counts (every rank in the same all-reduce), or a rank that reported nothing in the step: no one."""
    assert first_divergence({0: {}, 1: {}}, 2, {0: (0, _within(RAN, 1)), 1: (0, _within(RAN, 1))}) is None
    assert first_divergence({0: {}, 1: {}}, 2, {0: (0, _within(RAN, 1))}) is None


def test_a_collective_failure_is_told_from_an_exception_of_the_recipes_own() -> None:
    """gloo's and NCCL's errors (and torch's distributed errors) keep a rank's count; a KeyError or a shape error in
    the recipe's code does not."""
    import torch.distributed as dist

    from harness.distributed.divergence import collective_failure

    assert collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert collective_failure(dist.DistBackendError("NCCL error: unhandled system error"))
    assert not collective_failure(KeyError("labels"))
    assert not collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"))


def test_at_a_deadline_only_a_step_some_rank_finished_is_read_from_inside() -> None:
    """At a deadline a rank that began fewer synchronizations inside a step nobody finished may only be slower: no
    one is named. Where a peer finished the step, its all-reduce completed, so the rank that began none went on to
    another collective, and is named."""
    working = {0: (0, _within(RAN, 1)), 1: (0, _within(SKIPPED, 0))}
    assert first_divergence({0: {}, 1: {}}, 2, working, settled=False) is None
    history = {0: {0: _done(0)}, 1: {}}
    found = first_divergence(history, 2, {0: (1, _within(RAN, 0)), 1: (0, _within(SKIPPED, 0))}, settled=False)
    assert found is not None and [1] == found[0]
