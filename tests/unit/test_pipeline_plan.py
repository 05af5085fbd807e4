"""A pipelined run's accumulation plan (``--pp-steps`` A, ``--pp-microbatches`` M): a window as A equal-shaped
steps, empty ones included, and ``one_sync`` judged at one synchronization per schedule step, on runs assembled by
hand from the battery's own references (no rank starts)."""

from __future__ import annotations

import pytest

from harness.battery import mesh_scenarios
from harness.battery.judge import checks
from harness.battery.launch.run import Run, WindowRecord
from harness.battery.plan.options import RunSpec
from harness.battery.prepare.steps import Prepared, prepare
from harness.core.mesh import Mesh
from harness.core.microbatch import IGNORE_INDEX
from harness.distributed.pipeline import Pipeline, ScheduleStep

CORRECT = "harness.recipes:pipeline_token_mean"
MESH = Mesh.parse("dp=2,pp=2")


def _prepared(scenario: str, steps: int) -> Prepared:
    spec = RunSpec(CORRECT, scenario, MESH.world_size, "fp32", layout=MESH, pp_steps=steps)
    return prepare(spec, mesh_scenarios.build(scenario, MESH), share_chain=True)


def test_a_window_runs_as_a_steps_of_one_shape_with_the_first_steps_empty_when_it_is_short() -> None:
    """:meth:`Pipeline.batches`: every step's batch has one shape (one schedule drives them all), the supervised tokens
    are the window's, each once; 2 microbatches in 3 steps leave the first step wholly ignored rows, which still
    run on every stage; a window of none is refused."""
    window = mesh_scenarios.build("uneven", MESH)[0][0]
    assert 2 == len(window)
    a, b = (mb.supervised for mb in window)
    for steps, counts in ((1, [a + b]), (2, [a, b]), (3, [0, a, b])):
        batches = Pipeline.batches(window, steps, 2)
        assert 1 == len({tuple(i.shape) for i, _ in batches} | {tuple(lab.shape) for _, lab in batches})
        assert counts == [int((lab != IGNORE_INDEX).sum()) for _, lab in batches]
        assert all(0 == i.shape[0] % 2 for i, _ in batches)
    with pytest.raises(ValueError, match="at least one microbatch"):
        Pipeline.batches([], 2, 2)


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
