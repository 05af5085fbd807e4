"""Tensor parallelism's parts that run without ranks: DDP over tp refused with its reason, where a model's plan comes
from (the built-in one, a user factory's ``tp_plan``, a factory without one refused naming what to add), and the
built-in model's padding to a multiple of the tp size leaving every real position's logits unchanged."""

from __future__ import annotations

import re

import pytest
import torch

from harness.battery.plan.options import BatteryOptions, RunSpec
from harness.battery.spec import ModelSpec
from harness.core.mesh import Mesh
from harness.distributed.tensor_parallel import builtin_plan, plan_of
from harness.model import ModelError

TP = Mesh.parse("dp=2,tp=2")


def test_ddp_over_a_tensor_parallel_mesh_is_refused_with_its_reason() -> None:
    """RunSpec names the strategy and the mesh, says what DDP does with DTensor parameters and what to use."""
    with pytest.raises(ValueError, match=re.escape("strategy='ddp' over the mesh dp=2,tp=2")) as info:
        RunSpec("harness.recipes:mesh_token_mean", "uneven", 4, layout=TP)
    assert "aten.cat.default got mixed torch.Tensor and DTensor" in str(info.value)
    assert "use --strategy fsdp2" in str(info.value)


def test_both_strategies_over_a_tensor_parallel_mesh_are_refused_at_parse() -> None:
    """``--strategy both`` includes DDP: refused before any case is planned, naming ``--strategy``."""
    with pytest.raises(ValueError, match=re.escape("--strategy='ddp' over the mesh dp=2,tp=2")):
        BatteryOptions.parse(mesh="dp=2,tp=2", strategy="both")


def test_fsdp2_over_a_tensor_parallel_mesh_is_accepted() -> None:
    """FSDP2 over dp with TP over tp (torchtitan's 2-D layout) is a run the battery makes."""
    assert (TP,) == BatteryOptions.parse(mesh="dp=2,tp=2", strategy="fsdp2").meshes
    assert TP == RunSpec("harness.recipes:mesh_token_mean", "uneven", 4, strategy="fsdp2", layout=TP).mesh


def test_the_built_in_model_gets_the_built_in_plan() -> None:
    """Without ``--model`` the plan is the harness's own."""
    assert builtin_plan is plan_of(None)


def test_a_user_factory_declares_its_plan_beside_it() -> None:
    """``factory.tp_plan`` is the plan."""
    from user_recipes.tp_models import mlp_plan

    assert mlp_plan is plan_of("user_recipes.tp_models:make_tp_model")


def test_a_user_factory_without_a_plan_is_refused_naming_what_to_add() -> None:
    """A ModelError (a usage error) naming the factory, the attribute and its signature."""
    with pytest.raises(ModelError, match=re.escape("set make_model_without_plan.tp_plan = plan")):
        plan_of("user_recipes.tp_models:make_model_without_plan")


@pytest.mark.parametrize("multiple", [2, 3, 4])
def test_padding_to_a_multiple_of_the_tp_size_leaves_every_logit_as_it_was(multiple: int) -> None:
    """Causal attention keeps the padding out of the real positions: the logits of an odd-length batch are the same
    (to float32 rounding: other matrix shapes) with and without the padding, and have the batch's length."""
    model = ModelSpec().build()
    inputs = torch.randint(1, 32, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(inputs)
        model.seq_multiple = multiple
        padded = model(inputs)
    assert plain.shape == padded.shape
    torch.testing.assert_close(padded, plain, atol=1e-6, rtol=1e-5)
