"""A real ``transformers.Trainer`` built in a recipe's step: the hygiene verdict names
``transformers.trainer_utils.set_seed``, ``Trainer.__init__`` and the recipe's line
(``tests/user_recipes/seeding.py``)."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks
from harness.battery.launch import runner
from harness.recipes.libraries._common import EXTRA_HINT

pytestmark = pytest.mark.integrations


def test_a_trainer_built_in_the_step_is_named_as_what_seeded_the_generators() -> None:
    """``Trainer.__init__`` calls ``set_seed(args.seed)``: the verdict names both and the recipe's line."""
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    verdict = checks.hygiene(runner.run("user_recipes.seeding:TransformersTrainerInStep", "uneven", 2))
    assert "fail" == verdict.status
    assert "called by `transformers.trainer_utils.set_seed` (transformers/trainer_utils.py:" in verdict.message
    assert "called from `Trainer.__init__` (transformers/trainer.py:" in verdict.message
    assert "in TransformersTrainerInStep.backward_window: `transformers.Trainer(model=model.module, args=args)`" \
        in verdict.message
    assert verdict.fix is not None and "Trainer(...) seeds the global generators" in verdict.fix
