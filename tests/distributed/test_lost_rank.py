"""A rank that skips a collective its peers run is named, with its window, as the cause of the failed run, whatever
symptom ended it: at W=3 the rank that skipped its backward goes on to its next window's count all-reduce, which
pairs with its peers' DDP bucket and aborts in gloo ("Received data size doesn't match expected size"): a lost rank
with a stack, unless the ranks' own per-window reports (:mod:`harness.distributed.divergence`) name it. A rank that
skips only its last microbatch's backward dies inside the window, before any report of a finished window: its reports
from inside the window name it."""

from __future__ import annotations

import pytest

from harness.battery import scenarios
from harness.battery.judge import checks
from harness.battery.launch import runner

SKIP = "harness.recipes:skip_backward_when_empty"
SKIP_LAST = "harness.recipes:skip_backward_of_empty_microbatch"


def _empty_on(rank: int, window: int, world: int) -> scenarios.Windows:
    """The ``varying`` scenario (3 windows) with no supervised token on ``rank`` in ``window``."""
    windows = scenarios.build("varying", world)
    windows[window][rank] = [scenarios.unsupervised(mb) for mb in windows[window][rank]]
    return windows


@pytest.mark.slow
@pytest.mark.parametrize(("world", "rank", "window"), [(3, 1, 0), (2, 1, 1)], ids=["world3-window0", "world2-window1"])
def test_a_rank_that_skips_its_backward_on_an_empty_window_is_named_with_the_window(
        world: int, rank: int, window: int) -> None:
    """Named as the cause on the verdict's first line (a desync), the peers' stacks kept below it."""
    verdict = checks.parity(runner.run_windows(SKIP, _empty_on(rank, window, world), deadline=30))
    assert "desync" == verdict.cause
    first = verdict.message.splitlines()[0]
    assert (f"rank {rank} skipped the forward and backward of window {window} (no gradient synchronization): every "
            "rank must run the same collectives") in first, verdict.message


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")
def test_a_rank_that_skips_its_last_microbatchs_backward_is_named_before_gloos_abort(world: int) -> None:
    """Rank 1's last microbatch of ``sparse`` has no token; it skips that backward (DDP's all-reduce) and all-reduces
    its logged loss, which meets its peers' gradient bucket: gloo aborts inside the window, before any rank finished
    it. The ranks' reports from inside the window name rank 1 and the microbatch first; gloo's words follow."""
    verdict = checks.parity(runner.run(SKIP_LAST, "sparse", world, deadline=30))
    assert "desync" == verdict.cause
    first, rest = verdict.message.split("\n", 1)
    assert ("rank 1 skipped the backward of window 0 (microbatch 3): its DDP all-reduce never ran, so the collective "
            f"{'rank 0 was' if world == 2 else 'ranks 0 and 2 were'} in met another one or none: every rank must run "
            "the same collectives") in first, verdict.message
    assert "collective mismatch" in rest, verdict.message


@pytest.mark.slow
def test_a_crash_on_one_rank_is_not_blamed_on_its_peer() -> None:
    """The control: rank 1 raises KeyError while rank 0 waits; no rank left a collective it finished, so the verdict
    stays a crash naming rank 1's exception, and no rank is named as having skipped anything."""
    verdict = checks.parity(runner.run("user_recipes.broken:CrashesOnRankOne", "uneven", 2))
    assert "crash" == verdict.cause
    assert "every rank must run the same collectives" not in verdict.message
