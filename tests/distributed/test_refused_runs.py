"""Runs refused in the preparation, before any rank, naming what to change. A recipe's own ``auxiliary_loss`` that
raises is the recipe's error: the run is refused naming the recipe, the exception and the fix, on the built-in model
and on a ``--model`` alike (a model's limit would make every case n/a, and the run would read "every check
holds"). A model that shards the sequence under a batch format that cannot carry a chunk's positions is refused as a
model that cannot be used."""

from __future__ import annotations

import pytest

from harness.battery.launch import runner
from harness.battery.prepare.objective import AuxiliaryError


@pytest.mark.parametrize("model", [None, pytest.param("harness.moe:moe", marks=pytest.mark.slow)])
def test_an_auxiliary_loss_that_raises_refuses_the_run_naming_the_recipe(model: str | None) -> None:
    with pytest.raises(AuxiliaryError, match=r"DictOnlyAuxiliary.*auxiliary_loss.*raised TypeError.*fix the recipe"):
        runner.run("user_recipes.broken:DictOnlyAuxiliary", "uneven", 2, model=model)


def test_a_sequence_sharding_model_under_the_hf_format_is_refused_as_a_model_that_cannot_be_used() -> None:
    """Refused in the preparation with a ModelError (the command line's one error line), naming the format."""
    from harness.battery.plan.options import RunSpec
    from harness.core.mesh import Mesh
    from harness.model import ModelError

    spec = RunSpec("harness.recipes:mesh_token_mean", "uneven", 4, "fp32", layout=Mesh.parse("dp=2,cp=2"),
                   model="harness.model:sequence_sharded", batch_format="hf")
    with pytest.raises(ModelError, match=r"shards the sequence .* batch format is hf.*--batch-format harness"):
        runner.run(spec)
