"""The package's layers import one way: a module never imports a layer above its own.

Order, bottom to top: core < data < model < dist < recipes < battery < training < testing < workflow. ``harness``'s
own ``__init__`` (the public contract), ``__main__`` and the ``python -m harness.train`` alias sit outside the order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HARNESS = Path(__file__).parents[2] / "harness"
ORDER = ("core", "data", "model", "dist", "recipes", "battery", "training", "testing", "workflow")
OUTSIDE = {"__init__", "__main__", "train"}


def layer_of(module: str) -> str | None:
    """``harness.data.plan`` -> ``data``; ``harness.model`` -> ``model``; anything else -> None."""
    parts = module.split(".")
    if parts[0] != "harness" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ORDER else None


def imported_modules(source: str, package: str) -> set[str]:
    """Every ``harness...`` module a source imports, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else package
            found.add(base)
            if base == "harness":  # from harness import dist: the names are the modules
                found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("harness")}


def violations(root: Path = HARNESS) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts)
        if len(rel.parts) == 2 and rel.parts[1] in OUTSIDE:
            continue
        own = layer_of(module)
        if own is None:
            continue
        for imported in imported_modules(path.read_text(), module.rsplit(".", 1)[0]):
            theirs = layer_of(imported)
            if theirs is not None and ORDER.index(theirs) > ORDER.index(own):
                out.append(f"{module} ({own}) imports {imported} ({theirs})")
    return sorted(set(out))


def test_no_module_imports_a_layer_above_its_own() -> None:
    """Lower layers never import upper ones."""
    assert [] == violations()


def test_the_layer_check_rejects_an_upward_import(tmp_path: Path) -> None:
    """A core module importing the battery is reported."""
    fake = tmp_path / "harness"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "loss.py").write_text("from harness.battery.runner import run\n")
    assert ["harness.core.loss (core) imports harness.battery.runner (battery)"] == violations(fake)


@pytest.mark.parametrize("layer", ORDER)
def test_every_layer_exists_as_a_folder_or_module(layer: str) -> None:
    """The folder names are the architecture diagram."""
    assert (HARNESS / layer).is_dir() or (HARNESS / f"{layer}.py").is_file()
