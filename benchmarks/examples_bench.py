"""The three library loops of ``examples/`` as a user runs them: each file copied into a directory outside this
checkout and checked from there with ``--quick``, then the full default battery, for its right loop (``recipe``) and
its wrong one (``wrong``), each a fresh ``python -m harness battery`` process (start-up, the model's probe and the
forkserver included).

    python benchmarks/examples_bench.py [--out benchmarks/results/examples.json]

Writes, per example and recipe, the command, its wall time, its exit status and its last line, and prints the
markdown table docs/libraries.md quotes (``python benchmarks/figures.py --write`` puts it there). Needs the
integrations extra (transformers, accelerate). Not a test: nothing here asserts a speed; the exit statuses are the
ones the integrations lane asserts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, command, machine, now, write_result

EXAMPLES: dict[str, list[str]] = {
    "nanogpt_loop": [],
    "trainer_loop": ["--model", "trainer_loop:tiny_llama", "--batch-format", "hf"],
    "accelerate_loop": [],
}
"""Each example and the options its docstring runs it with."""

WAYS = {"--quick": ["--quick"], "full": []}


def _run(user: Path, module: str, attr: str, extra: list[str]) -> dict[str, Any]:
    argv = [sys.executable, "-m", "harness", "battery", f"--recipe={module}:{attr}", *EXAMPLES[module], *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    start = time.monotonic()
    done = subprocess.run(argv, cwd=user, env=env, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - start
    lines = done.stdout.strip().splitlines() or [""]
    return {"command": "python -m harness battery " + " ".join(argv[4:]), "wall_s": round(wall, 1),
            "exit_status": done.returncode, "last_line": lines[-1], "lines": len(lines)}


def markdown(data: dict[str, Any]) -> str:
    """The table: one row per example and recipe, the exit status and wall time of ``--quick`` and of the full
    battery, and the lines the full battery printed."""
    rows = ["| example | recipe | `--quick` | full battery | lines printed (full) |", "| --- | --- | --- | --- | --- |"]
    for name, by_recipe in data["results"].items():
        for attr, ways in by_recipe.items():
            q, f = ways["--quick"], ways["full"]
            rows.append(f"| `examples/{name}.py` | `{attr}` | exit {q['exit_status']}, {q['wall_s']:.1f} s | "
                        f"exit {f['exit_status']}, {f['wall_s']:.1f} s | {f['lines']} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS / "examples.json"))
    args = p.parse_args()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="examples-bench-") as tmp:
        user = Path(tmp)
        for name in EXAMPLES:
            shutil.copy(ROOT / "examples" / f"{name}.py", user / f"{name}.py")
            for attr in ("recipe", "wrong"):
                for way, extra in WAYS.items():
                    got = _run(user, name, attr, extra)
                    results.setdefault(name, {}).setdefault(attr, {})[way] = got
                    print(f"{name}:{attr} {way}: exit {got['exit_status']} in {got['wall_s']} s, {got['lines']} "
                          f"lines: {got['last_line'][:100]}", flush=True)
    data = {
        "command": command("benchmarks/examples_bench.py"),
        "what": "each example of examples/ copied outside the checkout and checked from there, a fresh process per "
                "command: --quick, then the full default battery (W=1-4, fp32 and fp64, every scenario, drawn "
                "layouts), for its right and wrong loop",
        "machine": machine(),
        "date": now(),
        "results": results,
    }
    write_result(args.out, data)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
