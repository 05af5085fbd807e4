"""The package's layers import one way: a module never imports a layer above its own.

Order, bottom to top: core < data < model < distributed < diagnosis < recipes < battery < audit < training < resume <
testing < workflow. ``harness``'s own ``__init__`` (the public contract), ``__main__`` and the ``python -m
harness.train`` alias sit outside the order.

Below every layer sits the test code (``tests/support/``, imported as ``support.<module>``): tests and benchmarks
import the package, never the other way round, and what moved out of the package stays out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

HARNESS = Path(__file__).parents[2] / "harness"
ORDER = ("core", "data", "model", "distributed", "diagnosis", "recipes", "battery", "audit", "resume", "training",
         "testing", "workflow")
OUTSIDE = {"__init__", "__main__", "train"}
BESIDE = {"moe": "model", "moe_plan": "model", "moe_tp": "model", "tp_layout": "model", "ulysses": "model"}
"""Modules beside a layer's own module that belong to its layer: ``harness.moe`` builds on ``harness.model``."""


def layer_of(module: str) -> str | None:
    """``harness.data.plan`` -> ``data``; ``harness.model`` and ``harness.moe`` -> ``model``; anything else -> None."""
    parts = module.split(".")
    if parts[0] != "harness" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ORDER else BESIDE.get(parts[1])


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
    (fake / "core" / "loss.py").write_text("from harness.battery.launch.runner import run\n")
    assert ["harness.core.loss (core) imports harness.battery.launch.runner (battery)"] == violations(fake)


@pytest.mark.parametrize("layer", ORDER)
def test_every_layer_exists_as_a_folder_or_module(layer: str) -> None:
    """The folder names are the architecture diagram."""
    assert (HARNESS / layer).is_dir() or (HARNESS / f"{layer}.py").is_file()


def module_graph(root: Path = HARNESS) -> dict[str, set[str]]:
    """Each module's imports of other modules of the package, wherever they stand: at module level, under
    ``if TYPE_CHECKING:`` (a type-only import is still a dependency a reader follows) and inside a function (a late
    import still runs, and a circle closed by one is still a circle: it only hides from the import system)."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module if node.level == 0 else package
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a loop (strongly connected components of
    more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_two_modules_import_each_other() -> None:
    """No circle between modules, even through a type-only or a late import: shared types live in a module of their
    own, and a helper (a printer) lives below the modules that use it."""
    assert [] == circles(module_graph())


def test_the_circle_check_finds_a_type_only_circle_and_a_late_import_circle(tmp_path: Path) -> None:
    """Its negative control: render importing report's types under TYPE_CHECKING while report imports render is a
    circle; so is the same import inside a function, and a loop of three closed by one; the late import alone, with
    nothing importing back, is not."""
    fake = tmp_path / "harness" / "workflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "report.py").write_text("from harness.workflow.render import write\n")
    (fake / "render.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from harness.workflow.report import Report\n")
    assert [["harness.workflow.render", "harness.workflow.report"]] == circles(module_graph(tmp_path / "harness"))
    (fake / "render.py").write_text("def write(r):\n    from harness.workflow.report import Report\n")
    assert [["harness.workflow.render", "harness.workflow.report"]] == circles(module_graph(tmp_path / "harness"))
    (fake / "render.py").write_text("from harness.workflow import resume\n")
    (fake / "resume.py").write_text("def run():\n    from harness.workflow.report import err\n")
    assert [["harness.workflow.render", "harness.workflow.report", "harness.workflow.resume"]] == circles(
        module_graph(tmp_path / "harness"))
    (fake / "report.py").write_text("")
    assert [] == circles(module_graph(tmp_path / "harness"))


# --- test code stays out of the package ------------------------------------------------------------------------------

MOVED_OUT = ("recipes/symmetry.py", "recipes/reduction.py", "data/sampling.py", "distributed/ports.py")
"""Modules that only tests and benchmarks used, now in ``tests/support/`` (the test-only probes and the metrics rank
body moved there too, out of modules that stay)."""

_NAMES_SUPPORT = re.compile(r"(?<![\w/])support\.[A-Za-z_]|\bfrom\s+support\s+import\b|\bimport\s+support\b")
"""``support.probes`` (an import, ``importlib.import_module("support.probes")``, a recipe path
``support.symmetry:join_token_mean``), ``from support import ...``, ``import support``; not ``tests/support/...``,
which a docstring may name."""


def moved_back(root: Path = HARNESS) -> list[str]:
    """The moved-out modules that exist under ``root`` again."""
    return [m for m in MOVED_OUT if (root / m).exists()]


def support_references(root: Path = HARNESS) -> list[str]:
    """Every line under ``root`` that imports or names a ``tests/support`` module (``path:line: text``)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _NAMES_SUPPORT.search(line):
                out.append(f"{path.relative_to(root).as_posix()}:{n}: {line.strip()}")
    return out


def test_no_moved_out_module_is_back_in_the_package() -> None:
    """Test-only code lives in tests/support/, not in the package users install."""
    assert [] == moved_back()
    assert all((Path(__file__).parents[1] / "support" / Path(m).name).is_file() for m in MOVED_OUT)


def test_no_harness_module_imports_the_test_support_code() -> None:
    """The product never depends on tests/support/ (which is not installed with it)."""
    assert [] == support_references()


def test_the_support_checks_reject_a_moved_module_and_a_harness_file_importing_support(tmp_path: Path) -> None:
    """Their negative controls: a fake package holding recipes/symmetry.py is reported, and so is each way a harness
    file can reach support (an import, from-import, a module name in a string); naming the folder in prose is not."""
    fake = tmp_path / "harness"
    (fake / "recipes").mkdir(parents=True)
    (fake / "recipes" / "symmetry.py").write_text("")
    assert ["recipes/symmetry.py"] == moved_back(fake)
    (fake / "distributed").mkdir()
    (fake / "distributed" / "probes.py").write_text(
        "from support.probes import identity\n"
        "import support\n"
        "from support import ports\n"
        "RECIPE = 'support.symmetry:join_token_mean'\n"
        "# the test bodies live in tests/support/probes.py; we support. Nothing else.\n"
    )
    assert [
        "distributed/probes.py:1: from support.probes import identity",
        "distributed/probes.py:2: import support",
        "distributed/probes.py:3: from support import ports",
        "distributed/probes.py:4: RECIPE = 'support.symmetry:join_token_mean'",
    ] == support_references(fake)


# --- one idea per module ---------------------------------------------------------------------------------------------

MAX_LINES = 450
"""A module past this many lines holds several ideas unless ``docs/layout.md`` says why splitting it would obscure
its one idea."""

LAYOUT_DOC = Path(__file__).parents[2] / "docs" / "layout.md"

_LONG_ROW = re.compile(r"^\|\s*`(harness/[\w/]+\.py)`\s*\|(.+)\|\s*$")


def long_modules_explained(doc: Path = LAYOUT_DOC) -> dict[str, str]:
    """The modules ``doc``'s "Long modules" section names (``| `harness/x.py` | why |`` rows), with their reasons."""
    text = doc.read_text()
    section = text.split("## Long modules", 1)[1].split("\n## ", 1)[0] if "## Long modules" in text else ""
    rows = (_LONG_ROW.match(line.strip()) for line in section.splitlines())
    return {m.group(1): m.group(2).strip() for m in rows if m and len(m.group(2).strip(" |")) > 20}


def too_long(root: Path = HARNESS, explained: dict[str, str] | None = None) -> list[str]:
    """``path (N lines)`` for each module over :data:`MAX_LINES` without a reason in ``docs/layout.md``, and
    ``path: named but N lines`` for a reason left behind by a module that is no longer long (or no longer exists)."""
    explained = long_modules_explained() if explained is None else explained
    out = []
    lengths = {f"harness/{p.relative_to(root).as_posix()}": len(p.read_text().splitlines())
               for p in sorted(root.rglob("*.py"))}
    for path, n in lengths.items():
        if n > MAX_LINES and path not in explained:
            out.append(f"{path} ({n} lines)")
    for path in explained:
        if lengths.get(path, 0) <= MAX_LINES:
            out.append(f"{path}: named but {lengths.get(path, 0)} lines")
    return out


def test_no_module_passes_the_line_limit_without_a_reason() -> None:
    """Every module of the package stays within 450 lines, or docs/layout.md says why it holds one idea."""
    assert [] == too_long()


def test_the_line_limit_check_rejects_a_long_module_and_a_stale_reason(tmp_path: Path) -> None:
    """Its negative control: a 451-line module nobody explained is reported, the same module with a reason is not,
    and a reason for a module that shrank (or a one-word reason) does not count."""
    fake = tmp_path / "harness"
    (fake / "battery" / "launch").mkdir(parents=True)
    (fake / "battery" / "plan").mkdir(parents=True)
    (fake / "battery" / "launch" / "runner.py").write_text("x = 1\n" * 451)
    (fake / "battery" / "plan" / "cases.py").write_text("x = 1\n" * 10)
    assert ["harness/battery/launch/runner.py (451 lines)"] == too_long(fake, {})
    doc = tmp_path / "layout.md"
    doc.write_text("# Layout\n\n## Long modules\n\n| module | why |\n| --- | --- |\n"
                   "| `harness/battery/launch/runner.py` | one table of signatures read top to bottom |\n"
                   "| `harness/battery/plan/cases.py` | the plan, which is one idea in a single list |\n"
                   "| `harness/battery/report/table.py` | short |\n\n## Configuration\n")
    explained = long_modules_explained(doc)
    assert {"harness/battery/launch/runner.py", "harness/battery/plan/cases.py"} == set(explained)
    assert ["harness/battery/plan/cases.py: named but 10 lines"] == too_long(fake, explained)
