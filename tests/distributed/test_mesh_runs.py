"""Battery runs over a dp x cp mesh: each cp rank supervised on its chunk of its data coordinate's positions, the
gradient reduced over every rank, the reference the single-device gradient over every data coordinate's window."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.battery.judge import checks
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.core.mesh import Mesh
from harness.recipes import CONTROLS, DIAGNOSES
from harness.workflow.cli import main

CORRECT = "harness.recipes:global_token_mean"
DP_ONLY = "harness.recipes:count_over_dp_only"
MESH = "harness.recipes:mesh_token_mean"


def mesh_run(recipe: str, shape: str = "dp=2,cp=2", chunking: str = "contiguous",
             scenario: str = "uneven", objective: str = "token_mean") -> runner.Run:
    mesh = Mesh.parse(shape)
    return runner.run(RunSpec(recipe, scenario, mesh.world_size, "fp32", layout=mesh, chunking=chunking,
                              objective=objective))


@pytest.mark.parametrize("chunking", ["contiguous", pytest.param("load_balanced", marks=pytest.mark.slow)])
def test_the_correct_recipe_passes_every_check_over_dp_and_cp(chunking: str) -> None:
    """Parity, one synchronization, ranks agreeing and the logged loss all hold at dp=2,cp=2, either chunking."""
    run = mesh_run(CORRECT, chunking=chunking)
    for check in (checks.parity, checks.one_sync, checks.ranks_agree, checks.logged_loss):
        verdict = check(run)
        assert verdict.passed, verdict.message


def test_a_count_over_the_data_parallel_group_only_fails_parity() -> None:
    """verl #5983: the count all-reduced over ``mesh["dp"]`` alone misses the other cp chunks' tokens, so every chunk's
    loss is scaled by the total over its own count (about the cp size); parity fails on the numbers."""
    verdict = checks.parity(mesh_run(DP_ONLY))
    assert not verdict.passed
    assert "numbers" == verdict.cause


def test_the_same_count_is_right_without_a_cp_dimension() -> None:
    """Its control: on dp=2 the dp group is every rank, so the same recipe passes (every cp bug vanishes at cp=1)."""
    verdict = checks.parity(mesh_run(DP_ONLY, "dp=2"))
    assert verdict.passed, verdict.message


@pytest.mark.parametrize("shape", ["dp=2,cp=2", "dp=3"])
def test_the_mesh_recipe_takes_its_groups_from_the_mesh_and_passes(shape: str) -> None:
    """``harness.recipes:mesh_token_mean`` (the count over ``token_group(mesh)``, the loss scaled by its size) passes
    parity and the logged loss over dp x cp, and on a one-dimensional mesh."""
    run = mesh_run(MESH, shape)
    for check in (checks.parity, checks.logged_loss, checks.one_sync):
        verdict = check(run)
        assert verdict.passed, verdict.message


def test_a_mesh_run_and_a_data_parallel_run_of_one_world_size_keep_their_own_references() -> None:
    """dp=2,cp=2 and dp=4 both run 4 ranks, over two and four data coordinates' windows: in one process, each is
    judged against the reference of its own windows (a cache keyed by the world size alone gave the second the
    first's)."""
    mesh = mesh_run(CORRECT)
    flat = runner.run(CORRECT, "uneven", 4)
    assert (2, 4) == (len(mesh.windows[0]), len(flat.windows[0]))
    verdict = checks.parity(flat)
    assert verdict.passed, verdict.message


@pytest.mark.slow
def test_the_command_line_judges_recipes_over_a_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m harness battery --mesh dp=2,cp=2``: the count over dp only fails (exit 1) and the mesh recipe
    passes, on the same cases, and the table's rows name the mesh."""
    common = ["battery", "--mesh", "dp=2,cp=2", "--battery-examples", "0", "--precision", "fp32"]
    assert 1 == main([*common, "--recipe", DP_ONLY])
    out = capsys.readouterr()
    assert "parity (uneven, W=4 dp=2,cp=2, fp32)" in out.out
    assert "first: parity of harness.recipes:count_over_dp_only (uneven, W=4 dp=2,cp=2, fp32)" in out.err
    assert 0 == main([*common, "--recipe", MESH])


def test_explain_reads_a_run_over_a_mesh(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``explain --mesh dp=2,cp=2`` on the count over dp only: the run is named with its mesh, the battery's checks
    reject it (exit 1), and the reading names the group: each cp chunk's tokens weigh N over its dp group's count
    (1.79x and 2.26x on uneven, whose chunks hold unequal counts)."""
    assert 1 == main(["explain", "--recipe", DP_ONLY, "--mesh", "dp=2,cp=2", "--outputs", str(tmp_path),
                      "--no-recipe-level"])
    out = capsys.readouterr().out
    assert f"{DP_ONLY} on scenario uneven, W=4 dp=2,cp=2, fp32" in out
    assert ("diagnosis (count_group): the count was reduced over dp (2 ranks); this window's tokens are spread over "
            "dp x cp (4 ranks): the tokens of ranks 0 and 2 (cp 0) (their group's count 442 of N=793) weigh "
            "1.79x") in out, out
    assert (tmp_path / "explain-harness.recipes-count_over_dp_only-uneven-W4-fp32-dp2xcp2.json").is_file()


@pytest.mark.parametrize("scenario", ["empty_shard", pytest.param("one_token", marks=pytest.mark.slow),
                                      pytest.param("cp_balanced", marks=pytest.mark.slow)])
def test_the_mesh_recipe_passes_every_mesh_scenario(scenario: str) -> None:
    """An empty cp shard, one supervised token in all, and shards of equal counts: the count over the token group
    is right on each, and no rank is left in a collective."""
    run = mesh_run(MESH, scenario=scenario, chunking="load_balanced")
    for check in (checks.parity, checks.logged_loss, checks.one_sync, checks.ranks_agree):
        verdict = check(run)
        assert verdict.passed, verdict.message


@pytest.mark.slow
def test_on_balanced_shards_a_count_over_dp_is_an_exact_factor_and_dp_s_factor_cancels_it() -> None:
    """cp_balanced: the count over dp reads every weight exactly 2.00x (the cp size), both groups of that share
    named; the count and the factor both from dp cancel there and pass (its target, uneven, rejects it)."""
    from harness.battery.diagnose.of_run import diagnose

    wrong = mesh_run(DP_ONLY, scenario="cp_balanced")
    read = diagnose(wrong)
    assert read is not None and "count_group" == read.signature.name
    assert "reduced over dp (2 ranks) or cp (2 ranks)" in read.signature.sentence
    assert "every weight is 2.00x" in read.signature.sentence
    assert checks.parity(mesh_run("harness.recipes:count_and_size_from_dp", scenario="cp_balanced")).passed


def test_explain_refuses_a_world_size_the_mesh_contradicts(capsys: pytest.CaptureFixture[str]) -> None:
    """``--world-size 2 --mesh dp=2,cp=2`` is a usage error (exit 2) naming both."""
    assert 2 == main(["explain", "--recipe", MESH, "--world-size", "2", "--mesh", "dp=2,cp=2"])
    assert "--world-size=2 but --mesh=dp=2,cp=2 has 4 ranks" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["dp=2,cp=2", "dp=3"])
def test_the_mesh_sequence_mean_passes_over_dp_and_cp(shape: str) -> None:
    """``harness.recipes.mesh_objectives:mesh_sequence_mean`` (each row's count all-reduced over cp, the sequences
    counted over dp) passes parity and the logged loss under ``--objective sequence_mean``, over dp x cp and on a
    one-dimensional mesh."""
    run = mesh_run("harness.recipes.mesh_objectives:mesh_sequence_mean", shape, objective="sequence_mean")
    for check in (checks.parity, checks.logged_loss, checks.one_sync):
        verdict = check(run)
        assert verdict.passed, verdict.message


def _sequence_mean_controls() -> list[object]:
    """Every control declared under ``--objective sequence_mean`` (``harness.recipes.CONTROLS``), with its declared
    reading; one whose batches are packed rows is skipped, saying why (packed rows are built for dp only)."""
    out: list[object] = []
    for name, target in CONTROLS.items():
        if target.objective != "sequence_mean":
            continue
        marks = [pytest.mark.skip(reason="packed rows are built for data-parallel ranks only, not for a cp chunk")
                 ] if target.batch_format == "packed" else []
        out.append(pytest.param(name, DIAGNOSES[name], marks=marks, id=name))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "reading"), _sequence_mean_controls())
def test_every_sequence_mean_control_reads_its_own_cause_over_cp(name: str, reading: str) -> None:
    """Under ``--objective sequence_mean`` on dp=2,cp=2 (uneven) every sequence-mean control fails parity and reads its
    declared signature: the chunk blocks divide by their rows' whole counts (a token mean reads ``other_objective``,
    a per-chunk mean ``per_shard_sequence_mean``), and the per-row weights are read against each hypothesis's over
    whole rows by data rank, then over chunks by token rank (a count local to each cp rank's chunk reads
    ``mean_of_local_means``, one per microbatch ``per_microbatch_mean``)."""
    verdict = checks.parity(mesh_run(f"harness.recipes:{name}", objective="sequence_mean"))
    assert not verdict.passed
    assert verdict.diagnosis is not None and reading == verdict.diagnosis["signature"], verdict.message
