"""Each library recipe gives, against the installed library, the verdicts ``harness.recipes.libraries.LIBRARY_RECIPES``
declares, and on each failing gradient the diagnosis signature it declares: a library release that changes its
behaviour fails here, naming the version measured and the reason the verdict was expected."""

from __future__ import annotations

import importlib.util

import pytest

import harness.battery.judge.checks  # noqa: F401  (the checks register themselves in REGISTRY when imported)
from harness.battery.diagnose.of_run import diagnose
from harness.battery.judge import registry
from harness.battery.launch import runner
from harness.recipes.libraries import CASES, LIBRARY_RECIPES, TESTED_WITH, LibraryRecipe, installed_version
from harness.recipes.libraries._common import EXTRA_HINT, TORCHTITAN_HINT

pytestmark = pytest.mark.integrations

_IMPORTS = {"transformers": "transformers.loss.loss_utils", "accelerate": "accelerate",
            "torchtitan": "torchtitan.components.loss"}


def _require(library: str) -> None:
    """Skip, with the install to run, unless the library is importable."""
    if importlib.util.find_spec(library) is None:
        pytest.skip(TORCHTITAN_HINT if library == "torchtitan" else EXTRA_HINT)
    pytest.importorskip(_IMPORTS[library], reason=EXTRA_HINT)


def _params() -> list[object]:
    out: list[object] = []
    for recipe in LIBRARY_RECIPES:
        for column in CASES:
            # A recipe's cases run on one xdist worker (--dist loadgroup): the cases sharing a launch launch it once,
            # and the worker's forkserver imports the recipe's library once.
            group = pytest.mark.xdist_group(recipe.name)
            out.append(pytest.param(recipe, column, id=f"{recipe.name}-{column.replace(' ', '_')}", marks=group))
    return out


@pytest.mark.parametrize(("recipe", "column"), _params())
def test_a_library_recipe_gives_its_declared_verdict(recipe: LibraryRecipe, column: str) -> None:
    _require(recipe.library)
    check, scenario, world, precision = CASES[column]
    run = runner.run(recipe.path, scenario, world, precision, strategy=recipe.strategy)
    verdict = registry.CHECKS[check](run)
    want = recipe.expect(column)
    version = installed_version(recipe.library)
    context = (f"{recipe.name} with {recipe.library} {version} (verdicts declared for {TESTED_WITH[recipe.library]}): "
               f"expected {check} ({scenario}, W={world}, {precision}) to {want.status} because {want.why}; "
               f"the battery said: {verdict.message}")
    assert want.status == verdict.status, context
    if want.status == "fail":
        assert "numbers" == verdict.cause, f"failed for another reason than its numbers: {context}"
    if want.finding is not None:
        assert want.finding == verdict.finding, context
    if want.note is not None:
        assert any(want.note in note for note in verdict.notes), context
    if want.diagnosis is not None:
        if check == "parity":
            assert verdict.diagnosis is not None, f"a failing parity verdict without a diagnosis: {context}"
            line = str(verdict.diagnosis["line"])
            signature = verdict.diagnosis["signature"]
        else:
            found = diagnose(run)
            assert found is not None, f"the run left no gradient to diagnose: {context}"
            line, signature = found.line(), found.signature.name
        assert want.diagnosis == signature, f"expected the diagnosis {want.diagnosis}, got {line}: {context}"


def test_every_declared_column_is_a_case() -> None:
    """The table names only the columns the tests and the README run."""
    assert [] == [(r.name, c) for r in LIBRARY_RECIPES for c in r.expected if c not in CASES]


def test_every_failing_parity_case_declares_its_diagnosis() -> None:
    """A failing parity verdict carries a diagnosis: the table says which, and only failures declare one."""
    parity = [c for c, case in CASES.items() if case[0] == "parity"]
    assert [] == [(r.name, c) for r in LIBRARY_RECIPES for c in parity
                  if r.expect(c).status == "fail" and r.expect(c).diagnosis is None]
    assert [] == [(r.name, c) for r in LIBRARY_RECIPES for c, e in r.expected.items()
                  if e.diagnosis is not None and e.status != "fail"]


def test_the_trainer_step_on_a_transformers_model_gives_the_global_token_mean(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A randomly initialized LlamaForCausalLM (``--model``) fed hf batches, its own loss with the gathered
    ``num_items_in_batch`` times W: the global token mean's gradient, one synchronization, the right logged loss."""
    _require("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is fetched: the model is built from a config
    run = runner.run("harness.recipes.libraries.transformers_loss:transformers_global_items_hf", "uneven", 2,
                     model="integrations.hf_models:tiny_llama", batch_format="hf")
    verdicts = [registry.CHECKS[c](run) for c in ("parity", "one_sync", "logged_loss", "hygiene")]
    assert [] == [v.message for v in verdicts if v.status != "pass"]


def test_accelerate_prepare_wraps_an_already_wrapped_model_in_a_second_ddp() -> None:
    """Why the accelerate recipes hand the harness's DDP model to ``accumulate``/``no_sync`` without ``prepare``:
    on two gloo ranks, ``prepare`` wraps a DDP model in another DDP (two reductions per backward)."""
    pytest.importorskip("accelerate", reason=EXTRA_HINT)
    from integrations.bodies import prepare_wrapped_model

    from harness.distributed.launcher import launch

    chains = launch(prepare_wrapped_model, 2, deadline=120)
    for chain in chains:
        assert ["DistributedDataParallel", "DistributedDataParallel", "TinyCausalLM"] == chain


def test_the_trainer_step_on_a_transformers_model_passes_the_float64_lanes_logged_loss_at_float32s_tolerances(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The float64 lane on a float64 Llama: its forward computes partly in float32 (the probe's note says the lane
    judges it at float32's tolerances), and so does its loss (``logits.float()``); the logged loss misses float64's
    tolerance by float32 rounding and is judged, as the note says, at float32's. The negative control: the same run
    with a logged loss off by 1e-3 (ten times float32's relative tolerance) still fails."""
    import dataclasses

    _require("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = runner.run("harness.recipes.libraries.transformers_loss:transformers_global_items_hf", "uneven", 2, "fp64",
                     model="integrations.hf_models:tiny_llama", batch_format="hf")
    assert "torch.float32" == run.computes_in
    assert any("judges it at torch.float32's tolerances" in note for note in run.notes), run.notes
    verdict = registry.CHECKS["logged_loss"](run)
    assert "pass" == verdict.status, verdict.message
    assert "(float32 tolerances: the model computes part of its forward in float32" in verdict.message
    assert verdict.max_error is not None and verdict.max_error > 1e-9, verdict.message  # over float64's tolerance
    assert run.records is not None
    off = [[dataclasses.replace(rec, logged=rec.logged * (1 + 1e-3)) if rec.logged is not None else rec
            for rec in records] for records in run.records]
    wrong = registry.CHECKS["logged_loss"](dataclasses.replace(run, records=off))
    assert ("fail", "numbers") == (wrong.status, wrong.cause), wrong.message


def test_the_trainer_recipes_build_their_trainer_without_moving_a_global_generator() -> None:
    """``setup(model=...)`` builds the recipe's ``Trainer`` around the DDP model's module with every global generator
    put back, and its accelerator sees both ranks; a bare ``Trainer(...)`` moves them (``set_seed`` in ``__init__``),
    which is why the recipes keep them."""
    _require("transformers")
    from integrations.bodies import trainer_seeding

    from harness.distributed.launcher import launch

    for kept, bare, processes in launch(trainer_seeding, 2, deadline=120):
        assert () == kept
        assert {"python random", "numpy", "torch CPU"} == set(bare)
        assert 2 == processes
