"""The recipe battery: does ``--recipe`` optimize the mean over every supervised token of the global window?

Every check runs on real gloo ranks at world sizes 1 to 4 (1 is the sanity lane) over the scenarios of
``harness.battery.scenarios`` and compares with the single-device reference (``--model`` and ``--batch-format`` pick the
model and the batch convention, for the ranks and the reference alike); the cases come from
``harness.battery.plan.cases``, the same list the command line runs. ``--precision`` picks the float32 lane, the float64
lane or both. A check that means nothing at one rank is skipped there as "not applicable". The negative controls in
``harness.recipes`` must fail these same checks (``tests/distributed/test_negative_controls.py`` shows that they do).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.battery.judge import registry
from harness.battery.judge.verdict import Verdict
from harness.battery.launch import runner
from harness.battery.plan import cases as plan
from harness.battery.plan.options import BatteryOptions

pytestmark = pytest.mark.recipe

Check = Callable[[Verdict], None]


def for_check(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark a test as the pytest face of one check; ``pytest_generate_tests`` gives it that check's cases."""

    def mark(fn: Callable[..., None]) -> Callable[..., None]:
        fn.battery_check_name = name  # type: ignore[attr-defined]
        return fn

    return mark


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    name = getattr(metafunc.function, "battery_check_name", None)
    if name is None or "case" not in metafunc.fixturenames:
        return
    from harness.battery.plan.options import from_pytest

    options = from_pytest(metafunc.config)
    cases = plan.session_cases(options, checks=(name,))
    if not cases and options.quick:  # say why, rather than pytest's "got empty parameter set"
        why = f"--quick: {name} runs on none of its scenarios; the full battery runs it"
        metafunc.parametrize("case", [pytest.param(None, id="quick", marks=pytest.mark.skip(reason=why))])
        return
    # One xdist group per launch: with --dist loadgroup the checks sharing a run stay on the worker that ran it.
    params = [pytest.param(c, id=c.id, marks=pytest.mark.xdist_group(c.run_key)) for c in cases]
    metafunc.parametrize("case", params)


@pytest.fixture
def judge(recipe_path: str, battery_options: BatteryOptions, battery_check: Check) -> Callable[[plan.Case], None]:
    """``judge(case)``: run (or reuse) the case's launch under the session's options (``--model``,
    ``--batch-format``, ``--battery-deadline``, ...), apply its check, and pass, fail or skip as n/a."""

    def apply(case: plan.Case) -> None:
        run = runner.run(battery_options.spec(recipe_path, case.scenario, case.world_size, case.precision,
                                              strategy=case.strategy, mesh=case.mesh))
        battery_check(registry.CHECKS[case.check](run))

    return apply


@for_check("parity")
def test_gradients_match_the_single_device_reference(case: plan.Case, judge: Callable[[plan.Case], None]) -> None:
    """After DDP's synchronization every rank's gradient is the single-device gradient of the global token mean."""
    judge(case)


@for_check("one_sync")
def test_each_window_synchronizes_gradients_exactly_once(case: plan.Case, judge: Callable[[plan.Case], None]) -> None:
    """All but the last microbatch run forward and backward inside no_sync(): one all-reduce pass per window."""
    judge(case)


@for_check("ranks_agree")
def test_parameters_are_identical_on_every_rank_after_each_step(
    case: plan.Case, judge: Callable[[plan.Case], None]
) -> None:
    """After the optimizer step every rank holds bitwise the same weights."""
    judge(case)


@for_check("logged_loss")
def test_a_logged_loss_is_the_global_token_mean_on_every_rank(
    case: plan.Case, judge: Callable[[plan.Case], None]
) -> None:
    """When the recipe returns the window's loss, it is the global token mean at its weights, on every rank."""
    judge(case)


@for_check("clipping")
def test_a_clipping_recipe_returns_the_global_norm_on_every_rank(case: plan.Case,
                                                                 judge: Callable[[plan.Case], None]) -> None:
    """A recipe that clips returns the reference's norm before clipping, over every parameter and every rank's
    tokens (not applicable to a recipe that does not clip)."""
    judge(case)


@for_check("hygiene")
def test_the_recipe_leaves_mode_random_generators_and_dtype_alone(
    case: plan.Case, judge: Callable[[plan.Case], None]
) -> None:
    """Train mode stays on, Python's, numpy's and torch's global generators do not move, gradients keep the dtype."""
    judge(case)


@for_check("empty_window")
def test_a_window_without_any_supervised_token_is_refused_or_left_at_zero_on_every_rank(
    case: plan.Case, judge: Callable[[plan.Case], None]
) -> None:
    """No supervised token anywhere: every rank raises ValueError, or every rank leaves zero gradients (no NaN, no
    inf); none hangs, and no weight is changed."""
    judge(case)


@for_check("weights_unchanged")
def test_the_recipe_leaves_every_weight_bitwise_unchanged(case: plan.Case, judge: Callable[[plan.Case], None]) -> None:
    """backward_window changes no weight: decay, steps and clamps belong to the training loop, after the call."""
    judge(case)
