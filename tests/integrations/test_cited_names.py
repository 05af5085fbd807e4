"""Every library name the package, the docs, the README and the examples cite resolves against the installed
libraries: a rename in a new transformers, accelerate or torchtitan release fails here, in CI, not in a user's run.

``CITED`` is the one list: each name as the text cites it, and the dotted path it means (``Trainer.train_step`` is
torchtitan's, ``Trainer.training_step`` transformers'). A test greps the cited files for dotted names of the three
libraries and for ``Trainer.``/``Accelerator.``/``TrainingArguments.`` attributes, and fails on any the list lacks:
the grep makes the list complete. ``GONE`` holds names cited as removed; they must stay unresolvable."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import re
from pathlib import Path

import pytest

from harness.recipes.libraries import installed_version
from harness.recipes.libraries._common import EXTRA_HINT

ROOT = Path(__file__).resolve().parents[2]

CITED: dict[str, str] = {
    "transformers.Trainer": "transformers.Trainer",
    "transformers.LlamaConfig": "transformers.LlamaConfig",
    "transformers.LlamaForCausalLM": "transformers.LlamaForCausalLM",
    "transformers.__version__": "transformers.__version__",
    "transformers.loss.loss_utils": "transformers.loss.loss_utils",
    "transformers.models.mixtral.modeling_mixtral": "transformers.models.mixtral.modeling_mixtral",
    "transformers.loss.loss_utils.ForCausalLMLoss": "transformers.loss.loss_utils.ForCausalLMLoss",
    "transformers.trainer_pt_utils": "transformers.trainer_pt_utils",
    "transformers.trainer_pt_utils.nested_gather": "transformers.trainer_pt_utils.nested_gather",
    "transformers.trainer_utils.set_seed": "transformers.trainer_utils.set_seed",
    "Trainer.__init__": "transformers.Trainer.__init__",
    "Trainer.train": "transformers.Trainer.train",
    "Trainer.training_step": "transformers.Trainer.training_step",
    "Trainer.get_batch_samples": "transformers.Trainer.get_batch_samples",
    "Trainer.compute_loss": "transformers.Trainer.compute_loss",
    "Trainer._inner_training_loop": "transformers.Trainer._inner_training_loop",
    "Trainer._get_num_items_in_batch": "transformers.Trainer._get_num_items_in_batch",
    "TrainingArguments.average_tokens_across_devices": "transformers.TrainingArguments.average_tokens_across_devices",
    "accelerate.Accelerator": "accelerate.Accelerator",
    "accelerate.commands.launch": "accelerate.commands.launch",
    "Accelerator.accumulate": "accelerate.Accelerator.accumulate",
    "Accelerator.backward": "accelerate.Accelerator.backward",
    "Accelerator.no_sync": "accelerate.Accelerator.no_sync",
    "Accelerator.reduce": "accelerate.Accelerator.reduce",
    "Accelerator.gradient_accumulation_steps": "accelerate.Accelerator.gradient_accumulation_steps",
    "torchtitan.components.loss": "torchtitan.components.loss",
    "torchtitan.components.loss.CrossEntropyLoss": "torchtitan.components.loss.CrossEntropyLoss",
    "torchtitan.distributed.utils": "torchtitan.distributed.utils",
    "torchtitan.distributed.utils.dist_sum_tensor": "torchtitan.distributed.utils.dist_sum_tensor",
    "Trainer.train_step": "torchtitan.trainer.Trainer.train_step",
    # torchtitan's MoE (harness.recipes.libraries.torchtitan_moe, docs/libraries.md "torchtitan's MoE")
    "torchtitan.distributed": "torchtitan.distributed",
    "torchtitan.distributed.minimal_async_ep": "torchtitan.distributed.minimal_async_ep",
    "torchtitan.distributed.parallel_dims": "torchtitan.distributed.parallel_dims",
    "torchtitan.models.common": "torchtitan.models.common",
    "torchtitan.models.common.attention": "torchtitan.models.common.attention",
    "torchtitan.models.common.config_utils": "torchtitan.models.common.config_utils",
    "torchtitan.models.common.moe": "torchtitan.models.common.moe",
    "torchtitan.models.common.moe.MoE": "torchtitan.models.common.moe.MoE",
    "torchtitan.models.common.moe_sharding": "torchtitan.models.common.moe_sharding",
    "torchtitan.models.common.moe_sharding.set_moe_sharding_config":
        "torchtitan.models.common.moe_sharding.set_moe_sharding_config",
    "torchtitan.models.common.nn_modules": "torchtitan.models.common.nn_modules",
    "torchtitan.models.qwen3.model": "torchtitan.models.qwen3.model",
    "torchtitan.models.qwen3.model.Qwen3Model": "torchtitan.models.qwen3.model.Qwen3Model",
    "torchtitan.models.qwen3.sharding": "torchtitan.models.qwen3.sharding",
    "torchtitan.tools.utils.device_type": "torchtitan.tools.utils.device_type",
}
"""Cited name -> the dotted path it means. Also names the recipes call without citing them in a docstring
(``Accelerator.accumulate``, ``.backward``, ...) are listed: what the recipes use must resolve too."""

GONE: dict[str, str] = {
    "Trainer._nested_gather": "transformers.Trainer._nested_gather",
}
"""Names cited as removed (transformers 5.25 moved ``Trainer._nested_gather`` to ``trainer_pt_utils.nested_gather``):
they must not resolve, so a citation of them as current would be caught by :func:`resolve` too."""

PATTERN = re.compile(r"\b(?:transformers|accelerate|torchtitan)(?:\.[A-Za-z_]\w*)+"
                     r"|\b(?:Trainer|Accelerator|TrainingArguments)\.[A-Za-z_]\w*")
"""A dotted library name as the docs cite it (a trailing ``()`` or backtick is not part of the match)."""

SCANNED = ("harness/**/*.py", "docs/**/*.md", "README.md", "examples/**/*.py", "benchmarks/*.py",
           "tests/integrations/*.py")


def cited_in_files() -> dict[str, list[str]]:
    """Each cited name -> the files citing it (this file excluded: its negative controls cite gone names)."""
    found: dict[str, list[str]] = {}
    for pattern in SCANNED:
        for path in sorted(ROOT.glob(pattern)):
            if path.resolve() == Path(__file__).resolve():
                continue
            for name in set(PATTERN.findall(path.read_text(encoding="utf-8"))):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def _static(origin: str, attrs: list[str]) -> bool:
    """Whether the source file ``origin`` defines the chain ``attrs`` (classes, functions, assignments), read without
    importing it: for a module whose own imports need packages the lane does not install (torchtitan's trainer
    imports torchdata)."""
    body: list[ast.stmt] = ast.parse(Path(origin).read_text(encoding="utf-8")).body
    for attr in attrs:
        hits = [n for n in body if (isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                                    and n.name == attr)
                or (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in n.targets))
                or (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == attr)]
        if not hits:
            return False
        body = getattr(hits[0], "body", [])
    return True


def resolve(dotted: str) -> str | None:
    """None when ``dotted`` names a module, or an attribute of one, in the installed libraries; else why not."""
    parts = dotted.split(".")
    try:
        obj: object = importlib.import_module(parts[0])
    except ModuleNotFoundError:
        return f"{dotted}: no module {parts[0]!r} is installed"
    for i, attr in enumerate(parts[1:], start=1):
        prefix = ".".join(parts[:i])
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
            continue
        if attr in getattr(obj, "__dataclass_fields__", {}) and i == len(parts) - 1:
            return None  # a dataclass field without a class default (TrainingArguments' options)
        path = getattr(obj, "__path__", None)
        if path is None:  # not a package: no submodule to import either
            return f"{dotted}: {prefix} has no attribute {attr!r}"
        spec = importlib.machinery.PathFinder.find_spec(attr, list(path))
        if spec is None or spec.origin is None:
            return f"{dotted}: {prefix} has no attribute or module {attr!r}"
        try:
            obj = importlib.import_module(f"{prefix}.{attr}")
        except ModuleNotFoundError as exc:
            # The module exists but imports a package the lane does not install: read its source instead.
            if _static(spec.origin, parts[i + 1:]):
                return None
            return f"{dotted}: {prefix}.{attr} (not importable here: no {exc.name}) defines no {parts[i + 1:]}"
    return None


def _library(dotted: str) -> str:
    return dotted.split(".")[0]


@pytest.mark.parametrize("lane", ["default", pytest.param("integrations", marks=pytest.mark.integrations)])
def test_every_library_name_the_docs_and_the_package_cite_is_in_the_list(lane: str) -> None:
    """In both lanes (it needs no library): the grep of the package, docs, README, examples and benchmarks finds no
    cited name missing from ``CITED``."""
    missing = {name: files for name, files in cited_in_files().items() if name not in CITED and name not in GONE}
    assert {} == missing, "add each to CITED in tests/integrations/test_cited_names.py with the path it means"


def test_the_grep_finds_a_cited_name_that_the_list_lacks() -> None:
    """The negative control of the grep: a docstring citing a name not in the list is found."""
    text = 'See ``transformers.trainer_utils.seed_worker`` and `Trainer.evaluate()`.'
    assert {"transformers.trainer_utils.seed_worker", "Trainer.evaluate"} == set(PATTERN.findall(text))
    assert "transformers.trainer_utils.seed_worker" not in CITED and "Trainer.evaluate" not in CITED


@pytest.mark.integrations
@pytest.mark.parametrize("cited", sorted(CITED))
def test_a_cited_library_name_resolves_in_the_installed_library(cited: str) -> None:
    dotted = CITED[cited]
    library = _library(dotted)
    if importlib.util.find_spec(library) is None:
        pytest.skip(EXTRA_HINT)
    if library == "torchtitan":
        # As the MoE model imports them: its module stands in for torchtitan's CUDA-only MinimalAsyncEP (triton),
        # without which torchtitan.models.common does not import on a CPU torch.
        importlib.import_module("harness.recipes.libraries.torchtitan_moe")
    problem = resolve(dotted)
    assert problem is None, f"{cited} (cited in {cited_in_files().get(cited, ['the recipes'])}) no longer resolves " \
                            f"in {library} {installed_version(library)}: {problem}; fix the citation and the code"


@pytest.mark.integrations
@pytest.mark.parametrize("gone", sorted(GONE))
def test_a_name_cited_as_removed_does_not_resolve(gone: str) -> None:
    """The negative control of :func:`resolve`: ``Trainer._nested_gather``, gone in transformers 5.25, is refused."""
    dotted = GONE[gone]
    if importlib.util.find_spec(_library(dotted)) is None:
        pytest.skip(EXTRA_HINT)
    problem = resolve(dotted)
    assert problem is not None and "_nested_gather" in problem


@pytest.mark.integrations
def test_resolve_refuses_a_renamed_module_and_a_missing_method_read_from_source() -> None:
    """A module renamed away and a method missing from a source read without importing it are both refused."""
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    assert "transformers.loss has no attribute or module 'loss_utilz'" in str(
        resolve("transformers.loss.loss_utilz.ForCausalLMLoss"))
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("needs torchtitan (bash scripts/integrations.sh)")
    assert resolve("torchtitan.trainer.Trainer.train_step") is None
    assert resolve("torchtitan.trainer.Trainer.train_stepp") is not None
