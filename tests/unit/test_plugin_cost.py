"""The installed pytest plugin costs a project that runs no battery test nothing: no torch, battery or recipes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]

# Runs pytest in-process on the folder given, then says which heavy modules the whole session imported (the battery's
# options, harness.battery.plan.options, are pure Python and parsed at start-up on every session: not heavy).
SESSION = """
import sys, pytest
rc = pytest.main(["-q", "-p", "harness.testing.plugin", "-p", "no:cacheprovider", *sys.argv[1:]])
heavy = sorted(m for m in ("torch", "harness.battery.launch.runner", "harness.battery.judge.checks",
                           "harness.battery.judge.registry", "harness.battery.judge.verdict", "harness.recipes")
               if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
sys.exit(int(rc))
"""


def _session(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", SESSION, *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=120)


def _project(tmp_path: Path, body: str) -> Path:
    (tmp_path / "test_other.py").write_text(body)
    return tmp_path


def test_a_session_without_battery_tests_imports_no_torch(tmp_path: Path) -> None:
    """Options and markers are registered (``-m gpu`` is a known marker), and nothing heavy is imported."""
    project = _project(tmp_path, "import pytest\n\n@pytest.mark.gpu\ndef test_marked():\n    pass\n\n"
                                 "def test_plain():\n    pass\n")
    done = _session(project, "--strict-markers", "--precision=fp32")
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    assert "HEAVY=\n" in done.stdout, done.stdout


def test_importing_the_plugin_imports_no_torch() -> None:
    code = "import harness.testing.plugin, harness.testing.skips, sys; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "False" == done.stdout.strip(), done.stderr


def test_a_bad_recipe_is_still_a_usage_error_before_anything_runs(tmp_path: Path) -> None:
    project = _project(tmp_path, "def test_plain():\n    raise AssertionError('must not run')\n")
    done = _session(project, "--recipe=bad.path:x")
    assert 4 == done.returncode, done.stdout + done.stderr
    assert "--recipe: recipe='bad.path:x': importing 'bad.path' failed" in done.stderr
    assert "must not run" not in done.stdout


@pytest.mark.slow
def test_without_recipe_the_fixture_names_the_correct_recipe(tmp_path: Path) -> None:
    from harness.recipes import CORRECT_RECIPE

    project = _project(tmp_path, f"def test_default(recipe_path):\n    assert recipe_path == {CORRECT_RECIPE!r}\n")
    done = _session(project)
    assert 0 == done.returncode, done.stdout + done.stderr
