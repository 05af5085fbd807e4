"""Battery runs over a mesh with pp: the model split into stages, each rank driving its stage through a
``torch.distributed.pipelining`` schedule, the full gradient gathered over pp and compared with the single-device
one."""

from __future__ import annotations

import itertools

import pytest

from harness.battery.diagnose.of_run import diagnose
from harness.battery.judge import checks
from harness.battery.judge.verdict import NOT_APPLICABLE
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.core.mesh import Mesh
from harness.recipes import CONTROLS, DIAGNOSES

CORRECT = "harness.recipes:pipeline_token_mean"
SCALE_GRADS = "harness.recipes:pp_scale_grads_with_accumulation"
REINITIALISED = "harness.recipes:pp_reinitialised_stages"


def pp_run(recipe: str, shape: str = "pp=2", schedule: str = "gpipe", precision: str = "fp32",
           strategy: str = "ddp", scenario: str = "uneven", steps: int = 1, microbatches: int = 2) -> runner.Run:
    mesh = Mesh.parse(shape)
    return runner.run(RunSpec(recipe, scenario, mesh.world_size, precision, layout=mesh, pp_schedule=schedule,
                              strategy=strategy, pp_steps=steps, pp_microbatches=microbatches))


PLANS = [  # (schedule, A, M, strategy, scenario): every pair of two factors' values in some row (11 of the 72)
    ("gpipe", 1, 2, "ddp", "pp_uneven"),
    ("gpipe", 2, 4, "fsdp2", "pp_balanced"),
    ("1f1b", 3, 2, "fsdp2", "pp_empty_step"),
    ("1f1b", 1, 4, "ddp", "pp_balanced"),
    ("gpipe", 3, 4, "ddp", "pp_empty_step"),
    ("1f1b", 2, 2, "ddp", "pp_uneven"),
    ("gpipe", 1, 4, "fsdp2", "pp_uneven"),
    ("gpipe", 3, 2, "ddp", "pp_balanced"),
    ("gpipe", 1, 2, "ddp", "pp_empty_step"),
    ("gpipe", 2, 2, "ddp", "pp_empty_step"),
    ("gpipe", 3, 2, "ddp", "pp_uneven"),
]
"""The slow tier's plans over dp=2,pp=2: schedule {gpipe, 1f1b} x A {1, 2, 3} x M {2, 4} x strategy {ddp, fsdp2} x
scenario {pp_uneven, pp_balanced, pp_empty_step} pruned to pairwise coverage (a greedy cover; the full product is 72
runs); ``test_the_plans_cover_every_pair`` holds it to that."""


def _passes_the_plan(run: runner.Run, steps: int) -> None:
    for check in (checks.parity, checks.logged_loss, checks.ranks_agree):
        verdict = check(run)
        assert verdict.passed, verdict.message
    sync = checks.one_sync(run)
    if run.mesh.size("dp") > 1:
        assert sync.passed, sync.message
        # Visible: A steps synchronize A times (torch's schedules reduce at the end of every step).
        assert run.records is not None
        assert {steps} == {rec.syncs for records in run.records for rec in records}
    else:
        assert NOT_APPLICABLE == sync.status, sync.message


def test_the_pipeline_recipe_accumulates_a_window_over_two_schedule_steps() -> None:
    """``--pp-steps 2 --pp-microbatches 2`` at pp=2 on ``uneven``: the correct recipe takes the plan from its
    ``pipeline``, drives both steps by one schedule, and the gathered gradient, the logged loss and the ranks'
    parameters are right; both steps were recorded, each with M=2."""
    run = pp_run(CORRECT, steps=2, microbatches=2)
    _passes_the_plan(run, 2)
    assert run.records is not None
    assert [(2, False)] * 2 == [(s.n_microbatches, s.scale_grads) for s in run.records[0][0].pipeline_steps]


@pytest.mark.slow
def test_more_steps_than_the_window_has_microbatches_run_the_first_steps_empty() -> None:
    """A = 3 on ``uneven`` (2 microbatches per rank) at dp=2,pp=2 under FSDP2 stages: the first step holds no row
    of the window and still runs on every stage; the gradient is the window's, with 3 synchronizations per window
    (a battery session with ``--pp-steps 3`` runs every scenario, the one-microbatch ones too)."""
    run = pp_run(CORRECT, "dp=2,pp=2", strategy="fsdp2", steps=3)
    _passes_the_plan(run, 3)
    assert run.records is not None
    assert () == run.records[0][0].pipeline_steps[0].rows


def test_the_plans_cover_every_pair() -> None:
    """Every value pair of any two of the matrix's factors is in some plan of :data:`PLANS`."""
    factors = [("gpipe", "1f1b"), (1, 2, 3), (2, 4), ("ddp", "fsdp2"), ("pp_uneven", "pp_balanced", "pp_empty_step")]
    for i, j in itertools.combinations(range(len(factors)), 2):
        wanted = set(itertools.product(factors[i], factors[j]))
        assert wanted == {(plan[i], plan[j]) for plan in PLANS}, (i, j)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "steps", "microbatches", "strategy", "scenario"), PLANS,
                         ids=[f"{p[0]}-A{p[1]}-M{p[2]}-{p[3]}-{p[4]}" for p in PLANS])
def test_the_pipeline_recipe_passes_every_plan(schedule: str, steps: int, microbatches: int, strategy: str,
                                               scenario: str) -> None:
    """Over dp=2,pp=2, A schedule steps of M microbatches: parity, the logged loss and ranks_agree hold, and
    one_sync counts exactly A synchronizations per window on every rank (one per step, DDP's all-reduce or FSDP2's
    reduce-scatter). On ``pp_empty_step`` a step without a token still steps every stage: the run ends."""
    _passes_the_plan(pp_run(CORRECT, "dp=2,pp=2", schedule, strategy=strategy, scenario=scenario, steps=steps,
                            microbatches=microbatches), steps)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved1f1b", "loopedbfs"])
@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("microbatches", [2, 4])
def test_every_schedule_accumulates_exactly_under_every_plan(schedule: str, steps: int, microbatches: int) -> None:
    """The full schedule x accumulation matrix at dp=2,pp=2 (DDP stages, ``pp_uneven``): every schedule the harness
    runs, one or two stages per rank, A = 1-3 steps of M = 2 or 4 microbatches, all exact, with A synchronizations
    per window."""
    _passes_the_plan(pp_run(CORRECT, "dp=2,pp=2", schedule, scenario="pp_uneven", steps=steps,
                            microbatches=microbatches), steps)


@pytest.mark.parametrize(("shape", "schedule", "strategy"), [
    ("pp=2", "gpipe", "ddp"),
    pytest.param("pp=2", "1f1b", "ddp", marks=pytest.mark.slow),
    pytest.param("dp=2,pp=2", "gpipe", "ddp", marks=pytest.mark.slow),
    pytest.param("dp=2,pp=2", "1f1b", "ddp", marks=pytest.mark.slow),
    pytest.param("dp=2,pp=2", "gpipe", "fsdp2", marks=pytest.mark.slow),
    pytest.param("dp=2,pp=2", "1f1b", "fsdp2", marks=pytest.mark.slow),
    ("pp=2", "interleaved1f1b", "ddp"),
    pytest.param("pp=2", "loopedbfs", "ddp", marks=pytest.mark.slow),
    pytest.param("dp=2,pp=2", "interleaved1f1b", "ddp", marks=pytest.mark.slow),
    pytest.param("dp=2,pp=2", "loopedbfs", "ddp", marks=pytest.mark.slow),
    pytest.param("dp=2,pp=2", "interleaved1f1b", "fsdp2", marks=pytest.mark.slow),
    pytest.param("dp=2,pp=2", "loopedbfs", "fsdp2", marks=pytest.mark.slow),
])
def test_the_pipeline_recipe_passes_parity_the_logged_loss_and_ranks_agree(shape: str, schedule: str,
                                                                           strategy: str) -> None:
    """``pipeline_token_mean`` (the count over dp, the loss sum times dp over it, ``scale_grads=False``, one schedule
    step per window): the gathered gradient is the single-device one, the logged loss the global token mean on every
    rank, the gathered parameters the same on every rank; one synchronization per window per stage where there is a
    dp to synchronize over (DDP's all-reduce, or FSDP2's reduce-scatter: the schedule's shape inference reduces
    nothing), and none to count (not applicable) at pp alone. Under FSDP2 each stage is sharded over dp and its
    gradient gathered with full_tensor before the gather over pp. Under interleaved1f1b and loopedbfs each rank holds
    2 of the 4 stages, each its own DDP or FSDP2 module, and a window synchronizes once when each of them did."""
    run = pp_run(CORRECT, shape, schedule, strategy=strategy)
    for check in (checks.parity, checks.logged_loss, checks.ranks_agree):
        verdict = check(run)
        assert verdict.passed, verdict.message
    sync = checks.one_sync(run)
    if Mesh.parse(shape).size("dp") > 1:
        assert sync.passed, sync.message
    else:
        assert NOT_APPLICABLE == sync.status, sync.message


@pytest.mark.slow
def test_the_pipeline_recipe_passes_in_float64() -> None:
    """The float64 lane: the gathered gradient matches to float64 tolerances."""
    verdict = checks.parity(pp_run(CORRECT, precision="fp64"))
    assert verdict.passed, verdict.message
    assert verdict.max_error is not None and verdict.max_error < 1e-15


@pytest.mark.slow
def test_scale_grads_left_on_over_two_steps_fails_parity_at_dp2() -> None:
    """torchtitan #1733 over dp=2,pp=2: the first step's gradient kept at 1/M fails parity on the numbers, and the
    diagnosis names it by its formula over both data ranks' recorded steps (the control's own test, at pp=2, is in
    test_negative_controls)."""
    verdict = checks.parity(pp_run(SCALE_GRADS, "dp=2,pp=2"))
    assert not verdict.passed
    assert "numbers" == verdict.cause
    assert verdict.diagnosis is not None and "pp_scale_grads" == verdict.diagnosis["signature"], verdict.message


@pytest.mark.slow
def test_scale_grads_left_on_over_two_steps_fails_parity_under_interleaved1f1b() -> None:
    """torchtitan #1733 with 2 stages per rank: each stage's gradient is divided by M at the end of every step, so
    the first step's is kept at 1/M as under gpipe; parity fails on the numbers and the diagnosis names the same
    formula over the recorded steps."""
    verdict = checks.parity(pp_run(SCALE_GRADS, schedule="interleaved1f1b"))
    assert not verdict.passed
    assert "numbers" == verdict.cause
    assert verdict.diagnosis is not None and "pp_scale_grads" == verdict.diagnosis["signature"], verdict.message


@pytest.mark.slow
def test_a_recipe_that_takes_no_pipeline_is_refused_with_the_fix() -> None:
    """A plain recipe on a pp mesh cannot run a stage: the run fails with the contract's message naming
    ``pipeline``."""
    run = pp_run("harness.recipes:mesh_token_mean")
    assert run.failure is not None
    assert "takes no pipeline keyword" in " ".join(run.failure.details.values())


@pytest.mark.slow
def test_reinitialised_stages_keep_every_step_on_ddp_stages_and_only_the_last_on_fsdp2() -> None:
    """NVIDIA-NeMo Automodel #3530: a new schedule per step re-infers the stage's shapes, and torch's cleanup after
    that sets the ``.grad`` of FSDP2-sharded parameters to None. On DDP stages the same recipe passes parity; on FSDP2
    stages the first step's gradient is lost and parity fails on the numbers (its control's own test, with its
    diagnosis, is in test_negative_controls)."""
    assert checks.parity(pp_run(REINITIALISED, "dp=2,pp=2")).passed
    verdict = checks.parity(pp_run(REINITIALISED, "dp=2,pp=2", strategy="fsdp2"))
    assert not verdict.passed
    assert "numbers" == verdict.cause


@pytest.mark.slow
def test_the_batterys_default_recipe_drives_the_pipeline_on_a_pp_mesh() -> None:
    """Without ``--recipe`` the battery judges ``harness.recipes:global_token_mean``; on a mesh with pp it drives the
    schedule as ``pipeline_token_mean`` does, so the default runs on every mesh and passes."""
    from harness.recipes import CORRECT_RECIPE

    run = pp_run(CORRECT_RECIPE)
    for check in (checks.parity, checks.logged_loss):
        verdict = check(run)
        assert verdict.passed, verdict.message


@pytest.mark.slow
@pytest.mark.parametrize(("name", "phrase"), [
    ("pp_count_over_world", "the count was reduced over pp x dp (4 ranks); this window's tokens are spread over dp (2 "
                            "ranks), and the ranks of pp hold the same tokens, so the count holds each 2 times: every "
                            "weight is 0.50x"),
    ("pp_global_count_default_scale_grads", "scale_grads=True divided each step's gradient by M again (step 0's "
                                            "gradient weighs 0.25)"),
    ("pp_microbatch_means_over_m_times_a", "divided by the window's K = M x A = 4 schedule microbatches, averaged over "
                                           "the token group's 2 ranks: a mean of the 7 schedule microbatches' means "
                                           "over 2 steps"),
    ("pp_microbatch_means_over_m_times_a", "step 1, microbatch 1 (n_k=56 of N=793) weighs 1.77x, rank 1 (pp 0, dp "
                                           "1)'s step 0, microbatch 0 (n_k=245) 0.405x"),
])
def test_each_pipeline_control_is_named_by_its_formula_in_words(name: str, phrase: str) -> None:
    """On its target (GPipe, ``uneven``): the count over dp x pp by the group it was reduced over, the global-count
    loss under the default scale_grads by the division by M, and the schedule microbatches' means by their formula,
    read per row (the schedule's chunks cut through the window's microbatches)."""
    target = CONTROLS[name]
    found = diagnose(pp_run(f"harness.recipes:{name}", target.mesh or "pp=2"))
    assert found is not None
    assert DIAGNOSES[name] == found.signature.name, found.line()
    assert phrase in found.line(), found.line()


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["uneven", "one_empty", "pp_uneven", "single", "one_token"])
@pytest.mark.parametrize(("schedule", "strategy"), [("gpipe", "ddp"), ("1f1b", "fsdp2")], ids=["gpipe", "1f1b-fsdp2"])
def test_scale_grads_left_on_reads_its_formula_wherever_it_fails(schedule: str, strategy: str, scenario: str) -> None:
    """torchtitan #1733 over dp=2,pp=2 (the plan's A=2 beside the control's own two steps): wherever parity fails,
    the diagnosis names ``pp_scale_grads`` by its formula over the recorded steps (a window's microbatches are cut
    into consecutive steps, so every microbatch lies in one step and weighs its step's ratio); where the first step
    holds no microbatch (``single``, ``one_token``) there is no earlier gradient to rescale, and it passes."""
    verdict = checks.parity(pp_run(SCALE_GRADS, "dp=2,pp=2", schedule, strategy=strategy, scenario=scenario, steps=2))
    if scenario in ("single", "one_token"):
        assert verdict.passed, verdict.message
        return
    assert not verdict.passed
    assert "numbers" == verdict.cause
    assert verdict.diagnosis is not None and "pp_scale_grads" == verdict.diagnosis["signature"], verdict.message
