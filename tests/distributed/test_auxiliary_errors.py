"""A recipe's own ``auxiliary_loss`` that raises is the recipe's error: the preparation refuses the run naming the
recipe, the exception and the fix, on the built-in model and on a ``--model`` alike (a model's limit would make every
case n/a, and the run would read "every check holds")."""

from __future__ import annotations

import pytest

from harness.battery.launch import runner
from harness.battery.prepare.objective import AuxiliaryError


@pytest.mark.parametrize("model", [None, "harness.moe:moe"])
def test_an_auxiliary_loss_that_raises_refuses_the_run_naming_the_recipe(model: str | None) -> None:
    with pytest.raises(AuxiliaryError, match=r"DictOnlyAuxiliary.*auxiliary_loss.*raised TypeError.*fix the recipe"):
        runner.run("user_recipes.broken:DictOnlyAuxiliary", "uneven", 2, model=model)
