"""The hygiene verdict names who moved a global random generator (``tests/user_recipes/seeding.py``): a library's
seeding function, its caller and the recipe's line; a draw; or ``setup()``, which runs under the same watch and
receives the wrapped model. The negative controls (a generator of its own; the Trainer built in ``setup`` with the
generators put back) pass."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks
from harness.battery.launch import runner

_RECIPES = "user_recipes.seeding"


def test_a_seeding_constructor_in_the_step_is_named_with_its_caller_and_the_recipes_line() -> None:
    """``Trainer(model)`` in ``backward_window``: the verdict names ``set_seed``, ``Trainer.__init__`` and the
    recipe's line, and its fix moves the construction into ``setup(self, model)``."""
    verdict = checks.hygiene(runner.run(f"{_RECIPES}:TrainerInStep", "uneven", 2))
    assert "fail" == verdict.status and 0 == verdict.window
    assert "set by `random.seed`/`numpy.random.seed`/`torch.manual_seed`" in verdict.message
    assert "called by `user_recipes.seeding_lib.set_seed` (user_recipes/seeding_lib.py:16)" in verdict.message
    assert "called from `Trainer.__init__` (user_recipes/seeding_lib.py:26)" in verdict.message
    assert ("called from your recipe at user_recipes/seeding.py:25 in TrainerInStep.backward_window: "
            "`trainer = Trainer(model)") in verdict.message
    assert verdict.fix is not None and "build it once, in setup(self, model)" in verdict.fix


def test_a_seeding_constructor_in_setup_is_reported_against_setup() -> None:
    """The same ``Trainer`` built in ``setup(model)``: the verdict says setup moved the generators, no window."""
    verdict = checks.hygiene(runner.run(f"{_RECIPES}:TrainerInSetup", "uneven", 2))
    assert "fail" == verdict.status and verdict.window is None
    assert "rank 0: the recipe's setup() moved the global random generator(s) python random, numpy, torch CPU" \
        in verdict.message
    assert "in TrainerInSetup.setup: `self.trainer = Trainer(model)`" in verdict.message
    assert verdict.fix is not None and "keep building it once in setup()" in verdict.fix


def test_a_draw_from_the_global_generator_is_called_a_draw() -> None:
    """``torch.randn`` without a generator in the step: no seeding call, a draw outside the model's forward."""
    verdict = checks.hygiene(runner.run(f"{_RECIPES}:GlobalDraw", "uneven", 2))
    assert "fail" == verdict.status
    assert ("moved the global random generator(s) torch CPU: drawn from (no seeding call was made), outside the "
            "model's forward") in verdict.message
    assert verdict.fix is not None and verdict.fix.startswith("draw from a generator of its own")


@pytest.mark.parametrize("name", ["OwnGenerator", "TrainerInSetupKept"])
def test_a_recipe_that_leaves_the_generators_alone_passes(name: str) -> None:
    """The negative controls: a generator of its own, and the Trainer built in ``setup(model)`` with the generators
    put back (its step checks that it receives the very model ``setup`` received: the wrapped one)."""
    run = runner.run(f"{_RECIPES}:{name}", "uneven", 2)
    assert [] == [v.message for v in (checks.hygiene(run), checks.parity(run)) if not v.passed]
