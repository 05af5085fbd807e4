"""The real-library table of the README: every library recipe (``harness.recipes.libraries.LIBRARY_RECIPES``) through
the battery's checks on the cases that tell them apart (``CASES``: W=2, the uneven, single and all_empty scenarios),
against the installed libraries.

    bash scripts/integrations.sh --co -q     # installs the libraries (torch held), collects only
    python benchmarks/library_table.py [--out benchmarks/results/libraries.json]

Writes the versions (torch, transformers, accelerate, torchtitan) and, per recipe and column, the verdict, its cause,
finding, max error and message as JSON, and prints the markdown table: library configuration | versions | verdict
per check | what to change when it fails. Exit 1 when a measured verdict differs from the declared one (the cell
says which), 2 when a library is missing.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cell(status: str, cause: str | None, finding: str | None, max_error: float | None, message: str) -> str:
    if status == "n/a":
        return "n/a"
    text = "PASS" if status == "pass" else "FAIL"
    syncs = re.search(r"synchronized gradients (\d+) times", message)
    if finding == "float32_computation":
        text += " (float32 loss)"
    elif cause not in (None, "numbers"):
        text += f" ({cause})"
    elif syncs:
        text += f" ({syncs.group(1)} syncs)"
    elif status == "fail" and max_error is not None:
        text += f" {max_error:.1e}"
    elif status == "fail" and "did not raise" in message:
        text += " (NaN, no error)"
    return text


def measure() -> dict[str, object]:
    from harness.battery import checks, runner
    from harness.recipes.libraries import CASES, LIBRARY_RECIPES, installed_version

    versions = {lib: installed_version(lib) for lib in ("torch", "transformers", "accelerate", "torchtitan")}
    missing = [lib for lib, v in versions.items() if v is None]
    if missing:
        sys.exit(f"library_table: {', '.join(missing)} not installed: run bash scripts/integrations.sh --co -q first")
    recipes = []
    start = time.monotonic()
    for recipe in LIBRARY_RECIPES:
        cells = {}
        for column, (check, scenario, world, precision) in CASES.items():
            v = checks.CHECKS[check](runner.run(recipe.path, scenario, world, precision))
            want = recipe.expect(column)
            cells[column] = {
                "check": check, "scenario": scenario, "world_size": world, "precision": precision,
                "status": v.status, "expected": want.status, "as_declared": v.status == want.status,
                "cause": v.cause, "finding": v.finding, "max_error": v.max_error, "message": v.message,
                "cell": _cell(v.status, v.cause, v.finding, v.max_error, v.message),
            }
            print(f"{recipe.name}: {column}: {cells[column]['cell']}", file=sys.stderr, flush=True)
        recipes.append({"recipe": recipe.path, "library": recipe.library, "configuration": recipe.configuration,
                        "fix": recipe.fix, "versions": {"torch": versions["torch"],
                                                        recipe.library: versions[recipe.library]},
                        "cases": cells})
    return {
        "schema": "harness.library-table/1",
        "command": "python benchmarks/library_table.py",
        "versions": versions,
        "python": platform.python_version(),
        "columns": {c: dict(zip(("check", "scenario", "world_size", "precision"), k)) for c, k in CASES.items()},
        "seconds": round(time.monotonic() - start, 1),
        "recipes": recipes,
    }


def markdown(result: dict[str, object]) -> str:
    columns = list(result["columns"])  # type: ignore[call-overload]
    head = ["library configuration", "versions", *columns, "what to change when it fails"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in result["recipes"]:  # type: ignore[attr-defined]
        versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items() if k != "torch")
        cells = []
        for c in columns:
            case = r["cases"][c]
            cells.append(case["cell"] if case["as_declared"] else f"{case['cell']} (declared {case['expected']})")
        name = r["recipe"].split(":")[-1]
        row = [f"`{name}`: {r['configuration']}", versions, *cells, r["fix"] or "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "libraries.json")
    args = parser.parse_args()
    result = measure()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    undeclared = [(r["recipe"], c) for r in result["recipes"] for c, case in r["cases"].items()  # type: ignore[attr-defined]
                  if not case["as_declared"]]
    for recipe, column in undeclared:
        print(f"measured verdict differs from the declared one: {recipe} {column}", file=sys.stderr)
    return 1 if undeclared else 0


if __name__ == "__main__":
    sys.exit(main())
