"""The recipe battery: does ``--recipe`` optimize the mean over every supervised token of the global window?

Every check runs on real gloo ranks at world sizes 1, 2 and 3 (1 is the single-rank sanity lane) and compares with
the single-device reference. The negative controls in ``harness.recipes`` must fail these same checks
(``tests/distributed/test_negative_controls.py`` shows that they do).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.battery import checks, runner
from harness.battery.checks import Verdict

pytestmark = pytest.mark.recipe

Check = Callable[[Verdict], None]


@pytest.fixture(params=(1, 2, 3), ids=lambda w: f"world{w}")
def world_size(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(params=(2, 3), ids=lambda w: f"world{w}")
def multi_rank_world_size(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(params=("fp32", "fp64"))
def precision(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_gradients_match_the_reference_on_uneven_windows(
    recipe_path: str, world_size: int, precision: str, battery_check: Check
) -> None:
    """Ranks in different length bands, prompts and padding: DDP's gradient equals the single-device one."""
    battery_check(checks.parity(runner.run(recipe_path, "uneven", world_size, precision)))


def test_gradients_match_the_reference_on_balanced_windows(
    recipe_path: str, world_size: int, precision: str, battery_check: Check
) -> None:
    """Every rank with the same token count: the easy case must hold too."""
    battery_check(checks.parity(runner.run(recipe_path, "balanced", world_size, precision)))


def test_consecutive_windows_match_the_reference_with_sgd_steps_between(
    recipe_path: str, world_size: int, precision: str, battery_check: Check
) -> None:
    """Three windows with the same recipe object and different token counts, SGD stepping between them."""
    battery_check(checks.parity(runner.run(recipe_path, "consecutive", world_size, precision)))


def test_a_short_final_window_matches_the_reference(
    recipe_path: str, world_size: int, precision: str, battery_check: Check
) -> None:
    """A last window of one microbatch per rank (not the usual two) is normalized by its own token count."""
    battery_check(checks.parity(runner.run(recipe_path, "short_final", world_size, precision)))


def test_a_rank_without_supervised_tokens_still_gets_the_right_gradient(
    recipe_path: str, multi_rank_world_size: int, precision: str, battery_check: Check
) -> None:
    """Rank 0 holds no supervised token while the others do: correct gradient, no hang."""
    battery_check(checks.parity(runner.run(recipe_path, "one_empty", multi_rank_world_size, precision)))


def test_a_window_without_any_supervised_token_is_refused_on_every_rank(
    recipe_path: str, world_size: int, battery_check: Check
) -> None:
    """No supervised token anywhere: every rank raises ValueError, no rank hangs, no weight changes."""
    battery_check(checks.empty_window(runner.run(recipe_path, "all_empty", world_size)))


def test_parameters_are_identical_on_every_rank_after_each_step(
    recipe_path: str, world_size: int, battery_check: Check
) -> None:
    """After the optimizer step every rank holds bitwise the same weights."""
    battery_check(checks.ranks_agree(runner.run(recipe_path, "consecutive", world_size)))


def test_each_window_synchronizes_gradients_exactly_once(
    recipe_path: str, world_size: int, battery_check: Check
) -> None:
    """All but the last microbatch run forward and backward inside no_sync(): one all-reduce pass per window."""
    battery_check(checks.one_sync(runner.run(recipe_path, "short_final", world_size)))


def test_a_logged_loss_is_the_global_token_mean_on_every_rank(
    recipe_path: str, world_size: int, battery_check: Check
) -> None:
    """When the recipe returns the window's loss, it is the global token mean, identical on every rank."""
    battery_check(checks.logged_loss(runner.run(recipe_path, "consecutive", world_size)))


def test_the_recipe_leaves_mode_rng_and_dtype_alone(
    recipe_path: str, world_size: int, precision: str, battery_check: Check
) -> None:
    """Train mode stays on, the global RNG state is untouched and gradients keep the model's dtype."""
    battery_check(checks.hygiene(runner.run(recipe_path, "uneven", world_size, precision)))
