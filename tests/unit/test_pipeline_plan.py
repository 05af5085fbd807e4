"""A pipelined run's accumulation plan (``--pp-steps`` A, ``--pp-microbatches`` M): refused before any rank starts
where a window cannot run as A steps, and judged by ``one_sync`` at one synchronization per schedule step, on runs
assembled by hand from the battery's own references (no rank starts)."""

from __future__ import annotations

import pytest

from harness.battery import checks, mesh_scenarios
from harness.battery.options import RunSpec
from harness.battery.prepare import Prepared, prepare
from harness.battery.run import Run, WindowRecord
from harness.core.mesh import Mesh
from harness.distributed.pipeline import ScheduleStep

CORRECT = "harness.recipes:pipeline_token_mean"
MESH = Mesh.parse("dp=2,pp=2")


def _prepared(scenario: str, steps: int) -> Prepared:
    spec = RunSpec(CORRECT, scenario, MESH.world_size, "fp32", layout=MESH, pp_steps=steps)
    return prepare(spec, mesh_scenarios.build(scenario, MESH), share_chain=True)


def test_more_steps_than_a_window_has_microbatches_is_refused_naming_the_option() -> None:
    """A = 3 on ``uneven`` (2 microbatches per rank) cannot give every step a microbatch: the error names
    ``--pp-steps``, the value, the window and the fix."""
    with pytest.raises(ValueError, match=r"--pp-steps=3 schedule steps but scenario 'uneven' has a window of 2 "
                                         r"microbatches per rank: each step takes at least one; use --pp-steps 2 or "
                                         r"less, or a scenario of longer windows \(pp_uneven"):
        _prepared("uneven", 3)


def test_as_many_steps_as_the_window_has_microbatches_is_accepted() -> None:
    """The valid twin: A = 3 on ``pp_uneven`` (3 microbatches per rank) prepares."""
    assert 3 == _prepared("pp_uneven", 3).spec.pp_steps


@pytest.fixture(scope="module")
def ready() -> Prepared:
    return _prepared("pp_uneven", 2)


def _run(ready: Prepared, syncs: int, steps: int) -> Run:
    """A run whose every rank recorded ``steps`` schedule steps and ``syncs`` synchronizations in window 0."""
    start = ready.chain.starts[0]
    recorded = tuple(ScheduleStep(2, False, ()) for _ in range(steps))
    rec = WindowRecord(grad=None, params_before=start, params_after=start, syncs=syncs, logged=None,
                       error=None, mode_changed=False, grad_dtypes=(), pipeline_steps=recorded)
    return ready.run([[rec] for _ in range(MESH.world_size)])


def test_one_sync_counts_one_synchronization_per_schedule_step_on_a_pipeline(ready: Prepared) -> None:
    """Two steps and two synchronizations pass, and the message says there were two per window."""
    verdict = checks.one_sync(_run(ready, 2, 2))
    assert verdict.passed, verdict.message
    assert "one synchronization per schedule step on every rank (up to 2 per window" in verdict.message


@pytest.mark.parametrize(("syncs", "steps"), [(3, 2), (2, 1), (1, 2), (2, 0)],
                         ids=["one_more_than_steps", "two_for_one_step", "fewer_than_steps", "no_step_recorded"])
def test_one_sync_fails_a_count_other_than_the_recorded_steps(ready: Prepared, syncs: int, steps: int) -> None:
    """Its negative controls: a synchronization more than the steps (a shape inference's backward reduced), fewer,
    or two where the recipe stepped no schedule through ``pipeline.step`` (expected 1) all fail."""
    verdict = checks.one_sync(_run(ready, syncs, steps))
    assert not verdict.passed
    assert f"synchronized gradients {syncs} times in a window of 3 microbatches; expected {max(1, steps)}" \
        in verdict.message
