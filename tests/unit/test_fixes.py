"""Every reading ends with its fix: each signature of the catalog, each reading a diagnosis module can return, each
norm the clipping check names and each check's failing verdict has one, and its words are the run's own (the
strategy's way to skip a synchronization, the objective's normalizer, the mesh's token group and pipeline)."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

import harness.diagnosis.clipping  # noqa: F401  (adds the clipping readings to the catalog)
from harness.battery.judge import registry
from harness.core.objectives import OBJECTIVES
from harness.diagnosis.fix_catalog import CHECK_FIXES, FIXES, NORM_FIXES
from harness.diagnosis.fixes import check_fix, fix_for, fix_table
from harness.diagnosis.row_weights import GROUPS
from harness.diagnosis.signature_catalog import SIGNATURES

HARNESS = Path(__file__).parents[2] / "harness"
STRATEGIES = ("ddp", "fsdp2")
MESHES = (None, "dp=4", "dp=2,cp=2", "dp=2,tp=2", "dp=2,pp=2", "dp_replicate=2,dp_shard=2")


def returned_readings() -> set[str]:
    """Every reading name a module of harness/ builds a Signature with, and the names its tables hand to one (the
    rows' groupings, the pipeline's formulas)."""
    names: set[str] = set()
    for path in HARNESS.rglob("*.py"):
        names |= set(re.findall(r'Signature\(\s*"(\w+)"', path.read_text()))
    names |= {name for _, _, name, _ in GROUPS}
    names |= set(re.findall(r'"(pp_\w+)"', (HARNESS / "diagnosis" / "pipeline.py").read_text()))
    return names


def named_norms() -> set[str]:
    """Every norm the clipping check's reading can name (its candidates' first element)."""
    text = (HARNESS / "diagnosis" / "clipping.py").read_text()
    return set(re.findall(r'\(\s*"((?:norm|clip|shard|local|pre)_\w+)",', text))


def failed_calls_without_fix(source: str) -> list[int]:
    """The lines of every ``failed(...)`` call in ``source`` that passes no ``fix=``."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "failed"
            and not any(k.arg == "fix" for k in node.keywords)]


def test_every_signature_of_the_catalog_has_a_fix_in_every_form() -> None:
    """Each catalog signature (the clipping readings included) has a fix, and its template fills under every
    strategy, objective and mesh (a field its forms lack would raise)."""
    assert set(SIGNATURES) - set(FIXES) == set()
    for name, strategy, objective, mesh in itertools.product(SIGNATURES, STRATEGIES, OBJECTIVES, MESHES):
        assert fix_for(name, strategy=strategy, objective=objective, mesh=mesh).strip(), name


def test_every_reading_a_diagnosis_module_can_return_has_a_fix() -> None:
    """The names the diagnosis modules build readings with all have fixes; a name without one is refused, naming
    the catalog to add it to (the control)."""
    found = returned_readings()
    assert {"per_microbatch_mean", "pp_scale_grads", "count_group", "clipped_per_tensor", "not_reduced_over_group",
            "packing_crosses_boundaries"} <= found  # the scan sees every module
    assert found - set(FIXES) == set()
    with pytest.raises(KeyError, match=r"fix_catalog\.FIXES"):
        fix_for("a_reading_nobody_wrote_a_fix_for")


def test_every_norm_the_clipping_check_names_has_a_fix() -> None:
    """Each named norm of the clipping check (its verdict's finding) has its own fix; an unnamed norm gets the
    check's own."""
    norms = named_norms()
    assert {"norm_reduced_again", "norm_l1", "pre_sync_norm", "local_shard_norm_over_group"} <= norms
    assert norms - set(NORM_FIXES) == set()
    assert NORM_FIXES["norm_l1"] == check_fix("clipping", finding="norm_l1")
    assert CHECK_FIXES["clipping"] == check_fix("clipping", finding=None)


def test_every_failing_verdict_of_the_checks_carries_a_fix() -> None:
    """Every ``failed(...)`` of harness/battery/judge/checks.py passes ``fix=``, and every registered check has a fix of
    its own; a call without one is found (the control)."""
    assert [] == failed_calls_without_fix((HARNESS / "battery" / "judge" / "checks.py").read_text())
    assert [2] == failed_calls_without_fix('x = 1\nfailed("one_sync", run, "twice", 0)\nfailed("a", r, "b", fix="c")')
    for name in registry.REGISTRY:
        assert check_fix(name).strip(), name


def test_the_per_microbatch_mean_fix_names_the_global_count_reduced_and_the_factor() -> None:
    """The fix says what to divide by, where it is reduced, when, the factor, and what not to divide by."""
    assert ("divide each microbatch's loss sum by the window's supervised count, all-reduced over every data-parallel "
            "rank before the first backward, times the world size (dist.get_world_size()); not by its own count, not "
            "by k") == fix_for("per_microbatch_mean")


def test_not_synchronized_is_fixed_in_the_strategy_s_own_words() -> None:
    """Under FSDP2 the fix names set_requires_gradient_sync and never no_sync(); under DDP the other way round;
    one_sync's fix follows the same forms."""
    for fix in (fix_for("not_synchronized", strategy="fsdp2"), check_fix("one_sync", strategy="fsdp2")):
        assert "set_requires_gradient_sync(False)" in fix and "set_requires_gradient_sync(True)" in fix
        assert "no_sync()" not in fix
    for fix in (fix_for("not_synchronized", strategy="ddp"), check_fix("one_sync", strategy="ddp")):
        assert "model.no_sync()" in fix and "require_backward_grad_sync" in fix
        assert "set_requires_gradient_sync" not in fix


def test_the_fix_divides_by_the_declared_objective_s_own_normalizer() -> None:
    """The token mean's fix divides by the supervised count, the sequence mean's by its sequences, the weighted
    mean's by its weight sum, a fixed normalizer's by its constant with nothing to all-reduce."""
    said = {o: fix_for("mean_of_local_means", objective=o) for o in OBJECTIVES}
    assert "by the window's supervised count, all-reduced" in said["token_mean"]
    assert "by the window's count of sequences with a supervised token, all-reduced" in said["sequence_mean"]
    assert "weight sum" in said["weighted_token_mean"] and "weighted loss sum" in said["weighted_token_mean"]
    assert "declared normalizer constant" in said["fixed_normalizer"]
    assert "all-reduced" not in said["fixed_normalizer"] and "nothing to reduce" in said["fixed_normalizer"]
    assert "weighted token mean" in check_fix("logged_loss", objective="weighted_token_mean")


def test_on_a_mesh_the_fix_reduces_over_the_token_group_and_a_pipeline_sets_scale_grads() -> None:
    """dp x cp: the count is reduced over the token group (token_group(mesh)) and scaled by its size; dp=W names
    neither helper (the control); a pipeline's fix turns scale_grads off."""
    cp = fix_for("count_group", mesh="dp=2,cp=2")
    assert "dp x cp (harness.recipes.token_group(mesh))" in cp and "token_group_size(mesh)" in cp
    plain = fix_for("per_microbatch_mean", mesh="dp=4")
    assert "token_group" not in plain and "every data-parallel rank" in plain
    assert "scale_grads=False" in fix_for("per_microbatch_mean", mesh="dp=2,pp=2")
    stages = fix_for("per_microbatch_mean", mesh="pp=2")  # two ranks, one token group of one: W is not the factor
    assert "token_group_size(mesh)" in stages and "get_world_size" not in stages
    assert "scale_grads=False" not in plain
    assert "data_group(mesh)" in fix_for("auxiliary_summed_over_ranks", mesh="dp=2,cp=2")


def test_a_scale_s_fix_names_the_factor_it_found() -> None:
    """A global scale of 1/W names the missing world size, 1/k the extra division by k, and an unnamed factor its
    value and the reading's words."""
    rows = [{"rank": r, "microbatch": m} for r in range(4) for m in range(3)]
    assert "multiply by the world size W=4, which is missing" in fix_for(
        {"signature": "global_scale", "factor": 0.25, "weights": rows})
    assert "drop the extra division by the microbatch count k=3" in fix_for(
        {"signature": "global_scale", "factor": 1 / 3, "weights": rows})
    odd = fix_for({"signature": "global_scale", "factor": 0.37, "weights": rows, "sentence": "a loss scale; more"})
    assert "0.37x the right one (a loss scale): undo that factor" in odd


def test_another_objective_s_fix_names_the_option_and_the_declared_quantity() -> None:
    """A gradient of the sequence mean judged under the token mean: judge it with --objective=sequence_mean, or divide
    by the supervised count, not by the sequences."""
    fix = fix_for({"signature": "other_objective", "objective_computed": "sequence_mean"})
    assert fix.startswith("judge it with --objective=sequence_mean where the sequence mean")
    assert "by the window's supervised count" in fix and "not by the global count of sequences" in fix


def test_model_faults_are_fixed_in_the_model_and_right_readings_change_nothing() -> None:
    """A model fault's fix is the model's; a right weighting's says there is nothing to change."""
    assert fix_for("model_not_fixed").startswith("fix the model, not the recipe")
    assert fix_for("packing_crosses_boundaries").startswith("fix the model, not the recipe")
    assert fix_for("correct").startswith("nothing to change")
    assert "--precision fp32" in fix_for("float32_computation")


def test_the_diagnosis_page_shows_the_catalog_s_fixes_as_they_are() -> None:
    """docs/diagnosis.md's table of fixes is fix_table() as it is now (regenerate it from there); a stale row is
    found (the control)."""
    page = (HARNESS.parent / "docs" / "diagnosis.md").read_text()
    shown = page.split("<!-- fix-table:", 1)[1].split("-->", 1)[1].split("<!-- /fix-table -->", 1)[0].strip()
    assert fix_table() == shown
    assert fix_table() != shown.replace("not by its own count, not by k", "not by k")
