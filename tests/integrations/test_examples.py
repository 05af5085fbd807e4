"""The three library loops of docs/libraries.md (``examples/nanogpt_loop.py``, ``examples/trainer_loop.py``,
``examples/accelerate_loop.py``) run as a user runs them: copied into a directory outside this checkout and checked
with ``python -m harness battery --recipe <module>:<attr> --battery-world-sizes 2 --precision fp32
--battery-examples 0``. Each correct recipe passes; each wrong one exits 1 and its parity failures carry the reading
the docs give it.

The Trainer's correct loop still fails ``empty_window``: with no supervised token anywhere its loss is 0/0 = NaN
beside zero gradients, and the battery's empty-window check asks for a ``ValueError``; the test allows that check
alone to fail (and only that check) until the check accepts zero gradients as the second correct policy.

The nanoGPT loop needs only torch: it runs in the default suite's slow tier. The others need the integrations extra
(the integrations lane)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.recipes.libraries._common import EXTRA_HINT

ROOT = Path(__file__).resolve().parents[2]

WRONG_READS = {"nanogpt_loop": "per_microbatch_mean", "trainer_loop": "mean_of_local_means",
               "accelerate_loop": "per_microbatch_mean"}
"""The diagnosis the wrong recipe's parity failure on the uneven scenario carries."""

MODEL_OPTIONS = {"trainer_loop": ["--model", "trainer_loop:tiny_llama", "--batch-format", "hf"]}
"""The options an example's docstring runs it with: the Trainer's on the Llama from a config it defines."""

EXAMPLES = [
    pytest.param("nanogpt_loop", marks=pytest.mark.slow),
    pytest.param("trainer_loop", marks=pytest.mark.integrations),
    pytest.param("accelerate_loop", marks=pytest.mark.integrations),
]


def battery(module: str, attr: str, user: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``examples/<module>.py`` copied into ``user`` and checked from there; the process and its JSON report."""
    if module != "nanogpt_loop":
        pytest.importorskip("transformers" if module == "trainer_loop" else "accelerate", reason=EXTRA_HINT)
    shutil.copy(ROOT / "examples" / f"{module}.py", user / f"{module}.py")
    report = user / f"{module}-{attr}.json"
    # The user's directory first; this checkout after it, so that the battery run is this tree's, not an installed one.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "harness", "battery", f"--recipe={module}:{attr}", *MODEL_OPTIONS.get(module, []),
         "--battery-world-sizes", "2",
         "--precision", "fp32", "--battery-examples", "0", f"--battery-report={report}"],
        cwd=user, env=env, capture_output=True, text=True, timeout=300,
    )
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(report.read_text())


@pytest.mark.parametrize("module", EXAMPLES)
def test_a_library_loops_correct_recipe_passes_from_a_users_directory(module: str, tmp_path: Path) -> None:
    done, report = battery(module, "recipe", tmp_path)
    failed = {c["check"] for c in report["checks"] if c["status"] == "fail"}
    assert set() == failed, done.stdout[-3000:]
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    assert [] == report["errors"]
    assert report["counts"]["pass"] > 0


@pytest.mark.parametrize("module", EXAMPLES)
def test_a_library_loops_wrong_recipe_fails_with_its_reading(module: str, tmp_path: Path) -> None:
    done, report = battery(module, "wrong", tmp_path)
    assert 1 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    uneven = [c for c in report["checks"] if (c["check"], c["scenario"]) == ("parity", "uneven")]
    assert ["fail"] == [c["status"] for c in uneven]
    assert WRONG_READS[module] == uneven[0]["diagnosis"]["signature"]
    assert f"diagnosis ({WRONG_READS[module]})" in done.stdout
