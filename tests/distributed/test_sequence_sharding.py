"""A model that shards the sequence itself under context parallelism (its factory's ``cp_plan``): each cp rank
receives only its chunk of every microbatch, with the chunk's positions, and its attention gathers the other chunks'
keys and values. The gradient must equal the single-device one over whole sequences, under either chunking."""

from __future__ import annotations

import pytest

from harness.battery.judge import checks
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.core.mesh import Mesh

SHARDED = "harness.model:sequence_sharded"
CORRECT = "harness.recipes:mesh_token_mean"


def sharded_run(recipe: str = CORRECT, model: str = SHARDED, chunking: str = "load_balanced",
                **fields: object) -> runner.Run:
    mesh = Mesh.parse("dp=2,cp=2")
    return runner.run(RunSpec(recipe, "uneven", mesh.world_size, "fp32", model=model, layout=mesh, chunking=chunking,
                              **fields))  # type: ignore[arg-type]


@pytest.mark.parametrize("chunking", ["load_balanced", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_a_sequence_sharding_model_passes_every_check_on_its_chunks(chunking: str) -> None:
    """Each cp rank forwards its chunk only (load-balanced: chunks i and 2cp-1-i), and the gathered attention gives
    the whole sequence's gradient: parity, the logged loss, one synchronization and ranks agreeing all hold."""
    run = sharded_run(chunking=chunking)
    for check in (checks.parity, checks.logged_loss, checks.one_sync, checks.ranks_agree):
        verdict = check(run)
        assert verdict.passed, verdict.message


@pytest.mark.slow
def test_an_attention_written_for_contiguous_chunks_fails_only_under_load_balancing() -> None:
    """The control: an attention that masks the gathered keys by the ranks' order is right on contiguous chunks and
    fails parity on the load-balanced ones (a rank's second chunk sees keys it must not, and misses others)."""
    model = "user_recipes.cp_models:contiguous_only"
    assert checks.parity(sharded_run(model=model, chunking="contiguous")).passed
    wrong = checks.parity(sharded_run(model=model))
    assert "fail" == wrong.status and "numbers" == wrong.cause, wrong.message


@pytest.mark.slow
def test_a_recipe_that_drops_the_chunk_positions_is_refused_naming_them() -> None:
    """A loop written for whole sequences calls ``model(mb.inputs)``: the sharding model raises, naming
    ``position_ids`` and the call to make."""
    run = sharded_run("user_recipes.cp_models:NoPositions")
    assert run.failure is not None
    assert "pass its positions, model(mb.inputs, position_ids=mb.positions)" in str(run.failure), run.failure


def test_a_sequence_sharding_model_in_the_hf_format_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match=r"shards the sequence .* and the batch format is hf"):
        sharded_run(batch_format="hf")
