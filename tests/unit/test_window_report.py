"""What a rank reports about a window (:mod:`harness.battery.rank.window_report`): from inside the window at each
forward and backward, the gradient synchronizations begun, and at its end a note naming the microbatch whose backward
(the one that synchronizes) it skipped. One process; the synchronization a forward prepares is a flag here."""

from __future__ import annotations

import torch

from harness.battery.rank.window_report import Passes, window_note

SYNCING = {"now": False}
"""Whether a forward run now prepares the synchronization (DDP: outside ``no_sync()``)."""


def _model() -> torch.nn.Module:
    with torch.random.fork_rng():  # the global generator stays where the test found it
        return torch.nn.Linear(3, 2)


def _window(model: torch.nn.Module, skip: set[int], n: int = 2) -> None:
    """A window of ``n`` microbatches whose last prepares the synchronization (``no_sync()`` around the others), the
    backward of the microbatches in ``skip`` left out."""
    for i in range(n):
        SYNCING["now"] = i == n - 1
        out = model(torch.ones(1, 3))
        if i not in skip:
            out.sum().backward()


def _passes(reports: list[tuple[int, str, int | None]]) -> tuple[Passes, torch.nn.Module]:
    model = _model()
    passes = Passes(lambda k, note, begun: reports.append((k, note, begun)))
    passes.attach(model)
    passes.count_syncs(lambda: SYNCING["now"], "DDP all-reduce")
    passes.reset(4, 2)
    return passes, model


def test_a_rank_that_skips_the_backward_of_the_synchronizing_microbatch_reports_it_from_inside_the_window() -> None:
    """Its last report before it goes on says which microbatch's backward it skipped, with no synchronization begun."""
    reports: list[tuple[int, str, int | None]] = []
    passes, model = _passes(reports)
    _window(model, skip={1})
    assert (4, "skipped the backward of window 4 (microbatch 1): its DDP all-reduce never ran", 0) == reports[-1]
    assert "skipped the backward of window 4 (microbatch 1; no gradient synchronization)" == window_note(
        4, 0, passes, "nonzero")


def test_a_rank_that_runs_every_backward_reports_the_synchronization_it_began() -> None:
    """The control: the same window with every backward run reports one synchronization begun, and names none."""
    reports: list[tuple[int, str, int | None]] = []
    passes, model = _passes(reports)
    _window(model, skip=set())
    assert (4, "ran the backward of window 4 (microbatch 1), which began the DDP all-reduce", 1) == reports[-1]
    assert passes.skipped_sync() is None
    assert "finished window 4 with 1 gradient synchronization" == window_note(4, 1, passes, "nonzero")


def test_a_skipped_backward_under_no_sync_begins_no_synchronization_and_is_not_named() -> None:
    """Microbatch 0 runs under ``no_sync()``: skipping its backward leaves the collectives as they were."""
    reports: list[tuple[int, str, int | None]] = []
    passes, model = _passes(reports)
    _window(model, skip={0})
    assert 1 == reports[-1][2] and passes.skipped_sync() is None


def test_without_a_synchronization_to_watch_nothing_is_reported_from_inside_the_window() -> None:
    """A strategy whose forwards' synchronizations are not known (FSDP2, a pipeline) counts nothing there."""
    reports: list[tuple[int, str, int | None]] = []
    model = _model()
    passes = Passes(lambda k, note, begun: reports.append((k, note, begun)))
    passes.attach(model)
    passes.reset(0, 1)
    model(torch.ones(1, 3)).sum().backward()
    assert [] == reports and passes.begun is None
