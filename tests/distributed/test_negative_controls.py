"""Every battery check is shown to reject a wrong recipe, and every scenario is shown to be needed.

Each control in ``harness.recipes`` reproduces a real mistake and names its target (``CONTROLS``): the check,
scenario and precision that must reject it, and how the mistake shows (its numbers, or a desync). Rejection counts
only when that targeted check fails for that reason, never because the run crashed. The "passes" tests document what
the seeds warn about: a wrong recipe that looks right on the easy windows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.groups import control_group

from harness.battery import scenarios
from harness.battery.diagnose.of_run import worst
from harness.battery.judge import checks, registry
from harness.battery.judge.failed_runs import crash_summary
from harness.battery.launch import runner
from harness.battery.launch.run import Run
from harness.battery.plan.options import BatteryOptions, RunSpec
from harness.battery.report.table import run_controls
from harness.core.mesh import Mesh
from harness.recipes import CONTROLS, DIAGNOSES, SCENARIO_CONTROLS, control_class
from harness.recipes.catalog import IN_PROCESS, unavailable

ROOT = Path(__file__).parents[2]


def control(name: str) -> str:
    return f"harness.recipes:{name}"


SLOW_FAMILIES = ("strategies", "clipping", "objectives", "context_parallel", "hsdp", "tensor_parallel", "pipeline",
                 "packed", "expert_parallel", "router_terms", "loss_parallel", "dynamic")
"""Families whose controls past the first run in the slow tier only."""

SLOW_CONTROLS = ("skip_backward_of_empty_microbatch", "trainer_router_loss_per_microbatch")
"""Controls that run in the slow tier only (a gloo abort inside the window: seconds per run; a transformers Trainer
on a transformers model: its import and construction on every rank)."""


def control_cases() -> list[object]:
    """``(control, world size)`` for every control: the world sizes its target declares (a mistake right at the W its
    author tested; past the first in the slow tier), else 2 and 3 (3 in the slow tier); a control whose target needs
    ranks on several nodes is skipped, saying so (every in-process rank is on one node; a torchrun test across nodes
    runs it)."""
    out: list[object] = []
    seen: set[str] = set()
    for n, t in CONTROLS.items():
        family = control_class(n).__module__.rsplit(".", 1)[-1]
        # The families' controls in SLOW_FAMILIES past the first of each run in the slow
        # tier (the test command's budget); every other control at W=2 in the default one.
        representative = (family not in SLOW_FAMILIES or family not in seen) and n not in SLOW_CONTROLS
        seen.add(family)
        for w in t.world_sizes or (2, 3):
            marks = [pytest.mark.xdist_group(control_group(n, w))]
            where = f"world{w}" if t.mesh is None else Mesh.parse(t.mesh).stem
            if (not t.world_sizes and w == 3) or (t.world_sizes and w != t.world_sizes[0]) or not representative:
                marks.append(pytest.mark.slow)
            if t.launch != IN_PROCESS:
                marks.append(pytest.mark.skip(reason=f"its target needs launch={t.launch!r}: ranks on more than one "
                                                     "node, where the in-process launcher has one"))
            if unavailable(t) is not None:
                marks.append(pytest.mark.skip(reason=str(unavailable(t))))
            out.append(pytest.param(n, w, id=f"{n}-{where}", marks=marks))
    return out


@pytest.mark.parametrize(("name", "world_size"), control_cases())
def test_each_control_is_rejected_by_its_targeted_check_for_its_own_mistake(name: str, world_size: int) -> None:
    """The targeted check fails, and it fails on the control's behaviour (numbers or desync), not on a crash; its
    gradient reads its declared diagnosis, and a failing parity verdict on the same run never reads correct."""
    results = run_controls([name], BatteryOptions(world_sizes=(world_size,)))
    (result,) = [r for r in results if r.verdict.world_size == world_size]
    assert result.rejected, result.verdict.message
    assert result.verdict.check == CONTROLS[name].check
    # The same run, diagnosed: the weights name the control's own mistake (harness.recipes.DIAGNOSES).
    line = result.diagnosis["line"] if result.diagnosis else "no gradient to read"
    assert DIAGNOSES[name] == result.signature, line
    # Every reading ends with its fix, and so does the failing verdict of a check's own comparison.
    assert result.diagnosis is None or result.diagnosis["fix"], line
    assert result.verdict.cause != "numbers" or result.verdict.fix, result.verdict.message
    # One truth, on the same cached run: a parity verdict that fails never reads "correct" (a control whose own check
    # is another reads "correct" only where parity passes).
    target = CONTROLS[name]
    run = runner.run(BatteryOptions(world_sizes=(world_size,)).spec(
        control(name), target.scenario, world_size, target.precision, batch_format=target.batch_format,
        strategy=target.strategy, objective=target.objective, mesh=target.layout, model=target.model))
    if run.failure is None and worst(run) is not None:
        parity = checks.parity(run)
        if not parity.passed and parity.diagnosis is not None:
            assert "correct" != parity.diagnosis["signature"], parity.message


@pytest.mark.parametrize(("name", "world_size"), [
    pytest.param("hard_coded_world_size", 2, marks=pytest.mark.xdist_group(control_group("hard_coded_world_size", 2))),
    pytest.param("averaged_count", 2, marks=pytest.mark.xdist_group(control_group("averaged_count", 2))),
    pytest.param("count_over_local_ranks", 2),
    pytest.param("count_over_local_ranks", 4),
])
def test_a_world_size_mistake_passes_parity_where_its_author_tested_it(name: str, world_size: int) -> None:
    """The other half of the world family's claim: a factor written for W=2 (or a count averaged, then doubled) is
    exactly right at W=2, and a count over the node-local ranks is right while every rank is on one node (every
    in-process run, also at the W=4 where it fails across two nodes). Only their declared targets reject them."""
    target = CONTROLS[name]
    assert world_size not in target.world_sizes or target.launch != IN_PROCESS
    verdict = checks.parity(runner.run(control(name), target.scenario, world_size, target.precision))
    assert verdict.passed, verdict.message


def test_a_count_over_the_node_local_ranks_fails_parity_on_two_nodes() -> None:
    """count_over_local_ranks at W=4 with its ranks' environment on two nodes of two (torchrun's LOCAL_WORLD_SIZE,
    GROUP_RANK; the launcher's nodes=2): each node's tokens are divided by that node's count, and the diagnosis reads
    the sub-group. Its negative control: the correct recipe on the same two nodes passes."""
    name = "count_over_local_ranks"
    target = CONTROLS[name]
    (world,) = target.world_sizes
    run = runner.run(RunSpec(control(name), target.scenario, world, target.precision, nodes=2))
    verdict = checks.parity(run)
    assert "fail" == verdict.status and "numbers" == verdict.cause, verdict.message
    assert verdict.diagnosis is not None
    assert DIAGNOSES[name] == verdict.diagnosis["signature"], verdict.diagnosis["line"]
    assert "LOCAL_WORLD_SIZE=2" in str(verdict.diagnosis["line"]), verdict.diagnosis["line"]
    good = runner.run(RunSpec(control("global_token_mean"), target.scenario, world, target.precision, nodes=2))
    assert checks.parity(good).passed


@pytest.mark.xdist_group(control_group("hard_coded_world_size", 4))
def test_run_controls_judges_a_control_at_its_declared_world_sizes_and_skips_one_that_needs_nodes() -> None:
    """Asked for W=2, a control that is right at W=2 still runs at W=4 (its declared world size); one that needs
    ranks on several nodes is not run, and progress says why."""
    said: list[str] = []
    results = run_controls(["hard_coded_world_size", "count_over_local_ranks"], BatteryOptions(world_sizes=(2,)),
                           said.append)
    assert [("hard_coded_world_size", 4)] == [(r.control, r.verdict.world_size) for r in results]
    assert results[0].rejected, results[0].verdict.message
    assert any(s.startswith("count_over_local_ranks: skipped") and "torchrun-nodes" in s for s in said), said


def _failing_checks(name: str, scenario: str, world_size: int = 2) -> list[str]:
    run = runner.run(control(name), scenario, world_size)
    names = ("empty_window",) if scenario == "all_empty" else ("parity", "one_sync", "ranks_agree", "logged_loss",
                                                               "hygiene")
    return [n for n in names if not registry.CHECKS[n](run).passed]


# Each runs its control on every scenario (seven launches): two in the default tier, every one in the slow tier.
_SCENARIO_CASES = [pytest.param(s, n, marks=() if s in ("one_empty", "long") else pytest.mark.slow)
                   for s, n in sorted(SCENARIO_CONTROLS.items())]


@pytest.mark.parametrize(("scenario", "name"), _SCENARIO_CASES)
def test_each_scenario_catches_a_control_that_every_other_scenario_passes(scenario: str, name: str) -> None:
    """What a scenario adds: its control fails it and passes every check of every other battery scenario (W=2)."""
    assert _failing_checks(name, scenario), f"{name} passes {scenario}"
    for other in scenarios.BATTERY_SCENARIOS:
        if other != scenario:
            assert [] == _failing_checks(name, other), f"{name} fails {other} too"


def test_the_mean_of_local_means_misses_by_at_least_100_tolerances_at_world2() -> None:
    """On the base uneven window the bias is not a rounding matter: the worst component misses by >= 100x."""
    verdict = checks.parity(runner.run(control("mean_of_local_means"), "uneven", 2))
    assert verdict.worst_ratio is not None and verdict.worst_ratio >= 100
    assert verdict.max_error is not None and verdict.max_error > 1e-4


def test_the_mean_of_local_means_passes_on_balanced_windows() -> None:
    """Equal token counts on every rank hide the bias: why a balanced window alone proves nothing."""
    assert checks.parity(runner.run(control("mean_of_local_means"), "balanced", 2)).passed


@pytest.mark.parametrize("name", ["mean_of_local_means", "no_world_size_factor"])
def test_rank_averaging_mistakes_pass_at_world1(name: str) -> None:
    """With one rank the mean of means is the token mean and W is 1: only a multi-rank run catches them."""
    assert checks.parity(runner.run(control(name), "uneven", 1)).passed


def test_an_extra_microbatch_division_is_exactly_right_on_a_one_microbatch_window() -> None:
    """Dividing by k=1 changes nothing: why windows of several microbatches are needed to catch it."""
    assert checks.parity(runner.run(control("extra_microbatch_division"), "single", 2)).passed


def test_extra_division_and_a_missing_world_factor_coincide_at_two_microbatches_and_two_ranks() -> None:
    """At k = W = 2 both mistakes halve the gradient; five microbatches tell them apart."""
    def grad(name: str, scenario: str) -> torch.Tensor:
        run = runner.run(control(name), scenario, 2)
        assert run.records is not None
        assert run.records[0][0].grad is not None
        return run.records[0][0].grad

    torch.testing.assert_close(grad("extra_microbatch_division", "uneven"), grad("no_world_size_factor", "uneven"),
                               atol=1e-7, rtol=1e-5)
    assert not torch.allclose(grad("extra_microbatch_division", "long"), grad("no_world_size_factor", "long"))


def test_never_using_no_sync_is_invisible_to_parity() -> None:
    """Its gradients agree with the reference: parity alone cannot see a missing no_sync, only the count can."""
    run = runner.run(control("never_no_sync"), "uneven", 2)
    assert checks.parity(run).passed
    assert "synchronized gradients 2 times" in checks.one_sync(run).message


def test_a_float32_loss_passes_in_float32_and_the_float64_lane_names_it() -> None:
    """A downcast is invisible at float32 tolerances; the float64 lane rejects it and says it is float32 rounding."""
    assert checks.parity(runner.run(control("float32_loss"), "uneven", 2, "fp32")).passed
    verdict = checks.parity(runner.run(control("float32_loss"), "uneven", 2, "fp64"))
    assert not verdict.passed
    assert "float32_computation" == verdict.finding
    assert "float32 rounding scale" in verdict.message and "--precision fp32" in verdict.message


def test_the_float64_lane_does_not_call_a_real_bug_float32_rounding() -> None:
    """A normalization mistake misses by far more than float32 rounding: no float32 finding."""
    verdict = checks.parity(runner.run(control("mean_of_local_means"), "uneven", 2, "fp64"))
    assert not verdict.passed and verdict.finding is None


def test_a_failure_message_names_check_world_window_precision_and_numbers() -> None:
    """The message says what differs: check, world size, window, precision, max error, ratio, components over."""
    message = checks.parity(runner.run(control("mean_of_local_means"), "uneven", 2)).message
    for part in ("check parity FAILED", "world 2", "window 0", "fp32", "max abs error", "worst ratio",
                 "components over tolerance"):
        assert part in message


def test_a_rank_that_leaves_its_peers_in_a_collective_is_reported_as_a_desync_naming_the_ranks() -> None:
    """The empty rank returns while its peers wait in DDP's all-reduce: stopped early, the rank that skipped named
    with its window as the cause, the stuck peer's stack shown."""
    verdict = checks.parity(runner.run(control("skip_backward_when_empty"), "one_empty", 2))
    assert "desync" == verdict.cause
    assert ("rank 0 skipped the forward and backward of window 0 (no gradient synchronization): every rank must run "
            "the same collectives") in verdict.message.splitlines()[0]
    assert "rank 1" in verdict.message


def _with_record(run: Run, rank: int, **change: object) -> Run:
    assert run.records is not None
    records = [list(r) for r in run.records]
    rec = records[rank][0]
    records[rank][0] = type(rec)(**{**rec.__dict__, **change})
    return Run(run.recipe, run.scenario, run.world_size, run.precision, run.windows, records, run.references)


def test_ranks_agree_rejects_ranks_that_step_from_different_weights() -> None:
    """The rank-agreement check compares parameters bitwise; a run whose ranks disagree is rejected."""
    good = runner.run(control("global_token_mean"), "varying", 2)
    assert good.records is not None
    assert checks.ranks_agree(good).passed
    skewed = _with_record(good, 1, params_after=good.records[1][0].params_after + 1e-7)
    assert not checks.ranks_agree(skewed).passed


@pytest.mark.parametrize("generator", ["python random", "numpy", "torch CPU", "torch CUDA"])
def test_hygiene_rejects_any_moved_global_generator(generator: str) -> None:
    """Each global generator the harness watches fails the check when moved (CUDA's too, shown on a record)."""
    good = runner.run(control("global_token_mean"), "uneven", 2)
    assert checks.hygiene(good).passed
    verdict = checks.hygiene(_with_record(good, 0, rng_changed=(generator,)))
    assert not verdict.passed and generator in verdict.message


def test_hygiene_rejects_a_changed_mode_or_dtype() -> None:
    """Leaving train mode, or gradients in another dtype than the model's, fails the check."""
    good = runner.run(control("global_token_mean"), "uneven", 2)
    for change in ({"mode_changed": True}, {"grad_dtypes": ("torch.float16",)}):
        assert not checks.hygiene(_with_record(good, 0, **change)).passed, change


@pytest.mark.parametrize("left", ["nonzero", "nonfinite"])
def test_the_empty_window_check_rejects_gradients_left_behind(left: str) -> None:
    """A refused window must leave no gradient but zeros: a record with gradients left fails."""
    good = runner.run(control("global_token_mean"), "all_empty", 2)
    assert checks.empty_window(good).passed
    assert not checks.empty_window(_with_record(good, 1, grads_left=left)).passed


def test_the_empty_window_check_rejects_weights_the_recipe_changed() -> None:
    """A recipe that edits weights before refusing the window fails (the harness itself never steps then)."""
    good = runner.run(control("global_token_mean"), "all_empty", 2)
    assert not checks.empty_window(_with_record(good, 0, weights_touched=1e-3)).passed


@pytest.mark.parametrize(("logged", "left", "says"), [
    (float("nan"), "nonfinite", "rank 1 raised ValueError and rank 0 returned nan on a window without any supervised "
                                "token, leaving NaN/inf in .grad: the ranks took different decisions"),
    (0.0, "zero", "rank 1 raised ValueError and rank 0 returned 0.0 on a window without any supervised token, leaving "
                  "zero gradients in .grad"),
    (2.5, "nonzero", "rank 1 raised ValueError and rank 0 returned 2.5 on a window without any supervised token, "
                     "leaving nonzero gradients in .grad"),
    (None, "none", "rank 1 raised ValueError and rank 0 returned None on a window without any supervised token, "
                   "leaving no gradient in .grad"),
], ids=["nan-nonfinite", "zero-zero", "number-nonzero", "none-none"])
def test_the_empty_window_verdict_names_what_a_rank_returned_where_its_peer_raised(
        logged: float | None, left: str, says: str) -> None:
    """A rank that returns on an empty window while its peer raises: a raise on some ranks only fails, and the verdict
    names the value that came back and the gradients left (tests/distributed/test_empty_window.py: every rank
    returning zero gradients passes)."""
    good = runner.run(control("global_token_mean"), "all_empty", 2)
    verdict = checks.empty_window(_with_record(good, 0, error=None, logged=logged, grads_left=left))
    assert not verdict.passed and says in verdict.message, verdict.message


def test_the_empty_window_verdict_of_a_late_refusal_names_the_nan_left_in_grad() -> None:
    """nan_gradients_then_raise raises the contract's ValueError after its 0/0 backward: NaN/inf left in .grad."""
    verdict = checks.empty_window(runner.run(control("nan_gradients_then_raise"), "all_empty", 2))
    assert not verdict.passed
    assert "rank 0 raised ValueError, but left NaN/inf in .grad for the next window to add to" in verdict.message, (
        verdict.message)


def test_a_check_that_cannot_apply_at_world1_says_so_instead_of_passing() -> None:
    """one_sync and ranks_agree at W=1 are "n/a", never "pass"."""
    run = runner.run(control("global_token_mean"), "uneven", 1)
    for check in (checks.one_sync, checks.ranks_agree):
        verdict = check(run)
        assert "n/a" == verdict.status and "not applicable" in verdict.message


def test_a_crash_message_keeps_the_exception_line_and_drops_the_caret_underline() -> None:
    """The innermost frame and the exception line, never Python's ^^^^ marks."""
    text = ('Traceback (most recent call last):\n  File "a.py", line 3, in f\n    g()\n    ^^^\n'
            '  File "b.py", line 9, in g\n    raise KeyError("k")\n    ~~~~~^^^^^\nKeyError: \'k\'\n')
    assert ['File "b.py", line 9, in g', "KeyError: 'k'"] == crash_summary(text)


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", [pytest.param("cached_count", marks=pytest.mark.slow),
                                  pytest.param("fixed_accumulation_steps", marks=pytest.mark.slow),
                                  "first_microbatch_never_syncs"])
def test_the_drawn_lane_rejects_a_wrong_recipe_and_shows_a_shrunk_layout(name: str) -> None:
    """Drawn layouts (derandomized, 12 examples) find mistakes that need several windows, five microbatches or a
    one-microbatch window, and the message shows the drawn layout and a smaller one that still fails."""
    pytest.importorskip("hypothesis")
    from harness.battery.layouts import drawn_verdict

    verdict = drawn_verdict(control(name), BatteryOptions(examples=12), derandomize=True)
    assert "fail" == verdict.status
    assert "shrunk" in verdict.message and verdict.message.count("Layout(") == 2


def test_a_rank_that_refuses_alone_is_reported_with_its_exception_while_its_peer_waits() -> None:
    """A guard on the local count: rank 0 raises ValueError and leaves; the desync names it and its exception."""
    verdict = checks.parity(runner.run(control("local_count_guard"), "one_empty", 2))
    assert "desync" == verdict.cause
    first = verdict.message.splitlines()[0]
    assert "rank 0" in first and "ValueError: no supervised token in this window" in first


def test_a_crash_names_the_rank_and_its_exception_line() -> None:
    """A KeyError on rank 1: the verdict names rank 1 and keeps the exception line."""
    verdict = checks.parity(runner.run("user_recipes.broken:CrashesOnRankOne", "uneven", 2))
    assert "crash" == verdict.cause
    assert "rank 1" in verdict.message and "KeyError: 'labels'" in verdict.message
