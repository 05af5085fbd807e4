"""The real-library table of the README: every library recipe (``harness.recipes.libraries.LIBRARY_RECIPES``) through
the battery's checks on the cases that tell them apart (``CASES``: W=2, the uneven, single and all_empty scenarios),
against the installed libraries.

    bash scripts/integrations.sh --co -q     # installs the libraries (torch held), collects only
    python benchmarks/library_table.py [--out benchmarks/results/libraries.json]

Writes the versions (torch, transformers, accelerate, torchtitan) and, per recipe and column, the verdict, its cause,
finding, max error, message and the gradient diagnosis (signature, factor, line: a failing parity verdict's, or the
run's own where the table declares one for another failing check) as JSON, and prints the markdown table: library
configuration | versions | verdict per check | diagnosis of the failing parity cases | what to change when it fails.
Exit 1 when a measured verdict or diagnosis differs from the declared one (the cell says which), 2 when a library is
missing.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.battery.judge.verdict import Verdict
    from harness.battery.launch.run import Run

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
    elif status == "pass" and (logged := re.search(r"logged (\S+) beside zero gradients", message)):
        # The empty window's zero-gradient policy with a NaN logged loss: a pass whose note says to skip the step.
        text += f" (logged {logged.group(1)}, zero grads: skip the step)"
    elif status == "fail" and (returned := re.search(r"returned (\S+) on a window without", message)):
        # What an empty window's rank returned: the logged loss, and NaN gradients where they were left.
        text += f" (returned {returned.group(1)}{', NaN grads' if 'NaN/inf in .grad' in message else ''}, no error)"
    return text


def reading(diagnosis: dict[str, object]) -> str:
    """The short reading of a diagnosis: its sentence's first clause, with the common factor where it is the point."""
    sentence = str(diagnosis["sentence"])
    cut = min((i for i in (sentence.find(": "), sentence.find("; "), sentence.find(" (")) if i >= 0),
              default=len(sentence))
    text = sentence[:cut]
    factor = diagnosis.get("factor")
    if diagnosis["signature"] == "global_scale" and isinstance(factor, float):
        text += f" (every weight {factor:.3g}x)"
    elif diagnosis["signature"] == "dropped" and isinstance(factor, float) and abs(factor - 1) > 1e-3:
        text += f" (the others {factor:.3g}x)"
    elif diagnosis["signature"] == "not_synchronized" and isinstance(factor, float):
        text += f" (its own microbatches {factor:.3g}x)"
    elif diagnosis["signature"] == "float32_computation":
        text += ", at float32 rounding"
    return text


def _diagnosis_of(run: Run, verdict: Verdict) -> dict[str, object] | None:
    """A failing parity verdict's diagnosis; for another check, the run's own (the worst window and rank)."""
    from harness.battery.diagnose.of_run import diagnose

    full = verdict.diagnosis
    if verdict.check != "parity":
        found = diagnose(run)
        full = None if found is None else found.to_dict()
    if full is None:
        return None
    return {k: full[k] for k in ("signature", "sentence", "line", "factor", "alternatives")}


def measure() -> dict[str, object]:
    import harness.battery.judge.checks  # noqa: F401  (the checks register themselves in REGISTRY when imported)
    from harness.battery.judge import registry
    from harness.battery.launch import runner
    from harness.recipes.libraries import CASES, LIBRARY_RECIPES, NOT_ROWS, installed_version

    versions = {lib: installed_version(lib) for lib in ("torch", "transformers", "accelerate", "torchtitan")}
    missing = [lib for lib, v in versions.items() if v is None]
    if missing:
        sys.exit(f"library_table: {', '.join(missing)} not installed: run bash scripts/integrations.sh --co -q first")
    recipes = []
    start = time.monotonic()
    for recipe in LIBRARY_RECIPES:
        cells = {}
        for column, (check, scenario, world, precision) in CASES.items():
            run = runner.run(recipe.path, scenario, world, precision, strategy=recipe.strategy)
            v = registry.CHECKS[check](run)
            want = recipe.expect(column)
            found = None
            if v.status == "fail" and (check == "parity" or want.diagnosis is not None):
                found = _diagnosis_of(run, v)
            signature = None if found is None else found["signature"]
            cells[column] = {
                "check": check, "scenario": scenario, "world_size": world, "precision": precision,
                "status": v.status, "expected": want.status,
                "as_declared": v.status == want.status and signature == want.diagnosis,
                "cause": v.cause, "finding": v.finding, "max_error": v.max_error, "message": v.message,
                "diagnosis": found, "diagnosis_expected": want.diagnosis,
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
        "not_rows": dict(NOT_ROWS),
    }


def diagnosis_cell(cases: dict[str, dict[str, object]]) -> str:
    """The failing parity cases' diagnoses: ``signature``: short reading, grouped; the columns named unless one reading
    holds for every parity column; ``-`` where parity passes."""
    parity = [c for c, case in cases.items() if case["check"] == "parity"]
    groups: dict[tuple[str, str], list[str]] = {}
    for column in parity:
        found = cases[column]["diagnosis"]
        if isinstance(found, dict):
            text = f"`{found['signature']}`"
            if found["signature"] != cases[column]["diagnosis_expected"]:
                text += f" (declared `{cases[column]['diagnosis_expected']}`)"
            groups.setdefault((text, reading(found)), []).append(column)
    if not groups:
        return "-"
    parts = []
    for (text, read), where in groups.items():
        named = "" if where == parity else f" ({', '.join(where)})"
        parts.append(f"{text}{named}: {read}")
    return "; ".join(parts)


def markdown(result: dict[str, object]) -> str:
    columns = list(result["columns"])  # type: ignore[call-overload]
    head = ["library configuration", "versions", *columns, "diagnosis", "what to change when it fails"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in result["recipes"]:  # type: ignore[attr-defined]
        versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items() if k != "torch")
        cells = []
        for c in columns:
            case = r["cases"][c]
            cells.append(case["cell"] if case["status"] == case["expected"]
                         else f"{case['cell']} (declared {case['expected']})")
        name = r["recipe"].split(":")[-1]
        row = [f"`{name}`: {r['configuration']}", versions, *cells, diagnosis_cell(r["cases"]), r["fix"] or "-"]
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
        print(f"measured verdict or diagnosis differs from the declared one: {recipe} {column}", file=sys.stderr)
    return 1 if undeclared else 0


if __name__ == "__main__":
    sys.exit(main())
