"""The battery runs on a user's recipe from another directory, through the installed package."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

installed = any(ep.value == "harness.testing.plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
requires_installed_plugin = pytest.mark.skipif(
    not installed, reason="needs the package installed (pip install -e .) so its pytest11 entry point is registered"
)


@pytest.mark.slow
@requires_installed_plugin
def test_the_installed_battery_checks_a_recipe_in_a_separate_directory(tmp_path: Path) -> None:
    """`pytest --pyargs harness.battery --recipe=...` from a directory that is not this checkout passes the example."""
    user = tmp_path / "userproject"
    user.mkdir()
    shutil.copy(ROOT / "examples" / "token_mean_recipe.py", user / "token_mean_recipe.py")
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(user)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "harness.battery", "-q",
         "--recipe=token_mean_recipe:recipe", f"--battery-report={report}", "--battery-world-sizes=1,2,4"],
        cwd=user, env=env, capture_output=True, text=True, timeout=600,
    )
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["expected"] == data["run"] >= 100 and 0 == data["exit_status"]
    assert "fail" not in {c["status"] for c in data["checks"]}
    assert {1, 2, 4} <= {c["world_size"] for c in data["checks"]}


@pytest.mark.slow
@requires_installed_plugin
def test_the_installed_battery_rejects_a_wrong_recipe_in_a_separate_directory(tmp_path: Path) -> None:
    """The same command fails on a user's mean-of-means recipe, naming the failed check."""
    user = tmp_path / "userproject"
    user.mkdir()
    source = (ROOT / "examples" / "token_mean_recipe.py").read_text()
    # The user's mistake: divide by the local count instead of scaling by world_size / N.
    wrong = source.replace("(s * (world / total)).backward()", "(s / max(local, 1)).backward()")
    assert wrong != source
    (user / "wrong_recipe.py").write_text(wrong)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "harness.battery", "-q",
         "--recipe=wrong_recipe:recipe", "-k", "uneven and world2"],
        cwd=user, env={**os.environ, "PYTHONPATH": str(user)}, capture_output=True, text=True, timeout=600,
    )
    assert 1 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    assert "check parity FAILED" in done.stdout


@pytest.mark.slow
@requires_installed_plugin
@pytest.mark.parametrize("scale_grads", ["False", "True"])
def test_the_pipeline_example_passes_on_a_pp_mesh_and_its_scale_grads_twin_is_named(tmp_path: Path,
                                                                                    scale_grads: str) -> None:
    """``examples/pipeline_recipe.py`` from another directory at ``--mesh pp=2 --pp-schedule 1f1b``: it passes every
    check of the uneven scenario; the same file with ``scale_grads=True`` (torch's default, with a loss already
    divided by the window's count and two steps per window) fails parity, read by its formula."""
    user = tmp_path / "userproject"
    user.mkdir()
    source = (ROOT / "examples" / "pipeline_recipe.py").read_text()
    edited = source.replace("scale_grads=False)", f"scale_grads={scale_grads})")
    assert 1 == edited.count(f"scale_grads={scale_grads})")
    (user / "pp_recipe.py").write_text(edited)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "harness.battery", "-q",
         "--recipe=pp_recipe:recipe", "--mesh", "pp=2", "--pp-schedule", "1f1b", "-k", "uneven and not drawn"],
        cwd=user, env={**os.environ, "PYTHONPATH": str(user)}, capture_output=True, text=True, timeout=600,
    )
    if scale_grads == "False":
        assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
        return
    assert 1 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    assert "check parity FAILED" in done.stdout
    assert "diagnosis (pp_divided_by_microbatches)" in done.stdout
