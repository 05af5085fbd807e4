"""Ulysses sequence parallelism (``--model harness.ulysses:ulysses``): each cp rank holds a chunk of every sequence,
and around attention two all-to-alls trade heads for positions and back. For the recipe it is cp: the correct mesh
recipe passes unchanged, the cp controls read as they do on the gathered attention, and the two Ulysses mistakes
(the loss scaled by dp where dp x sp averages, labels shifted again on each rank) are read by their own causes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.battery.diagnose.of_run import diagnose
from harness.battery.judge import checks
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.core.mesh import Mesh
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.data.config import Config
from harness.diagnosis.mesh import chunk_shifted_labels
from harness.model import ModelError, sequence_sharded
from harness.recipes import DIAGNOSES
from harness.recipes.controls.context_parallel import ULYSSES
from harness.ulysses import ulysses, ulysses_cp_plan

CORRECT = "harness.recipes:mesh_token_mean"


def ulysses_run(recipe: str = CORRECT, model: str = ULYSSES, chunking: str = "load_balanced", mesh: str = "dp=2,cp=2",
                **fields: object) -> runner.Run:
    layout = Mesh.parse(mesh)
    return runner.run(RunSpec(recipe, "uneven", layout.world_size, "fp32", model=model, layout=layout,
                              chunking=chunking, **fields))  # type: ignore[arg-type]


def test_the_mesh_recipe_passes_every_check_on_ulysses_attention() -> None:
    """The correct mesh recipe, unchanged (the count over dp x cp, the factor its size), on load-balanced chunks whose
    attention is Ulysses': parity, the logged loss, one synchronization and ranks agreeing all hold."""
    run = ulysses_run()
    for check in (checks.parity, checks.logged_loss, checks.one_sync, checks.ranks_agree):
        verdict = check(run)
        assert verdict.passed, verdict.message


@pytest.mark.slow
@pytest.mark.parametrize(("chunking", "strategy"), [("contiguous", "ddp"), ("contiguous", "fsdp2"),
                                                    ("load_balanced", "fsdp2")])
def test_the_mesh_recipe_passes_on_ulysses_under_either_chunking_and_strategy(chunking: str, strategy: str) -> None:
    verdict = checks.parity(ulysses_run(chunking=chunking, strategy=strategy))
    assert verdict.passed, verdict.message


@pytest.mark.slow
@pytest.mark.parametrize("name", ["count_over_dp_only", "own_shard_count", "count_and_size_from_dp"])
def test_the_cp_controls_read_on_ulysses_as_on_the_gathered_attention(name: str) -> None:
    """A count over the wrong group of the mesh is the same mistake whichever attention shards the sequence: each cp
    control fails parity on the Ulysses model and reads its declared cause."""
    run = ulysses_run(f"harness.recipes:{name}")
    assert not checks.parity(run).passed
    found = diagnose(run)
    assert found is not None and DIAGNOSES[name] == found.signature.name, found


@pytest.mark.slow
def test_the_loss_times_dp_reads_a_scale_of_one_over_cp_naming_the_token_group() -> None:
    """VeOmni PR #338's mistake: every gradient 1/cp of the reference's, named by the sizes, the token group's (dp x
    cp) where it belongs."""
    found = diagnose(ulysses_run("harness.recipes:loss_times_dp_under_sp"))
    assert found is not None and "global_scale" == found.signature.name, found
    assert found.signature.factor == pytest.approx(0.5, rel=1e-6)
    assert "where the token group's size (dp x cp: 4) belongs" in found.signature.sentence


@pytest.mark.slow
@pytest.mark.parametrize(("model", "chunking"), [(ULYSSES, "contiguous"),
                                                 ("harness.model:sequence_sharded", "load_balanced")])
def test_labels_shifted_again_on_each_rank_read_their_own_cause(model: str, chunking: str) -> None:
    """ms-swift PR #10185's mistake, on either sequence-sharding model and chunking: read labels_shifted_per_chunk,
    each shifted target at 1/N', the shifted labels' own count."""
    found = diagnose(ulysses_run("harness.recipes:labels_shifted_again_per_chunk", model=model, chunking=chunking))
    assert found is not None and "labels_shifted_per_chunk" == found.signature.name, found
    assert "the shifted labels' own count" in found.signature.sentence


@pytest.mark.slow
def test_a_cp_that_does_not_divide_the_heads_is_refused_before_any_rank_naming_both() -> None:
    with pytest.raises(ModelError, match=r"cp=3 does not divide n_heads=2: .*--mesh dp=2,cp=2"):
        ulysses_run(mesh="dp=1,cp=3")
    with pytest.raises(ModelError, match=r"cp=3 does not divide n_heads=2"):
        ulysses_cp_plan(ulysses(), SimpleNamespace(size=lambda: 3))


@pytest.mark.slow
def test_without_cp_the_ulysses_model_is_the_builtin_model_bit_for_bit() -> None:
    """The reference builds the factory without its plan: the same weights and logits as the built-in model."""
    inputs = torch.randint(1, Config().vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        a = ulysses()
        torch.manual_seed(3)
        b = sequence_sharded()
    assert torch.equal(a(inputs), b(inputs))


@pytest.mark.slow
def test_a_chunk_shift_moves_each_target_to_the_previous_held_position() -> None:
    """Load-balanced cp=2 over 8 positions: rank 0 holds 0, 1, 6, 7; its shifted labels put 1's target at 0, 6's at
    1 (across the chunk's gap), 7's at 6, and nothing at 7 or at any position it does not hold."""
    labels = torch.arange(10, 18).unsqueeze(0)
    got = chunk_shifted_labels(Microbatch(torch.ones_like(labels), labels), 0, 2, "load_balanced").labels
    i = IGNORE_INDEX
    assert [[11, 16, i, i, i, i, 17, i]] == got.tolist()
