"""``HARNESS_REQUIRE_GPUS=N``: a GPU lane needing at most N devices fails where it would skip; a bad value is refused.

The decision (:func:`harness.testing.skips.lane_verdict`) is tested directly; three pytest subprocesses, with CUDA
hidden (``CUDA_VISIBLE_DEVICES=""``) so that they see 0 devices on any machine, show the plugin turning it into a
skip, a failure and a usage error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.testing.skips import REQUIRE_GPUS_ENV, lane_verdict, required_gpus

ROOT = Path(__file__).resolve().parents[2]
GPU2_MESSAGE = (
    "HARNESS_REQUIRE_GPUS=2 but this machine has 0 CUDA devices: the gpu2 lane cannot run here "
    "(unset HARNESS_REQUIRE_GPUS to skip instead)"
)


# --------------------------------------------------------------------------------------------------- the decision


def test_unset_means_no_requirement() -> None:
    """No variable, no requirement."""
    assert required_gpus(None) is None


@pytest.mark.parametrize(("value", "expected"), [("1", 1), ("2", 2), (" 8 ", 8)])
def test_a_positive_integer_is_the_requirement(value: str, expected: int) -> None:
    """Digits (surrounding blanks ignored) give the number of devices required."""
    assert expected == required_gpus(value)


@pytest.mark.parametrize("value", ["0", "-1", "two", "", "1.5", "+2"])
def test_a_value_that_is_not_a_positive_integer_is_refused_naming_variable_value_and_fix(value: str) -> None:
    """0, negatives, words, an empty value and decimals are errors, never "no requirement"."""
    with pytest.raises(ValueError, match="not a positive integer") as info:
        required_gpus(value)
    message = str(info.value)
    assert f"HARNESS_REQUIRE_GPUS={value!r}" in message
    assert "HARNESS_REQUIRE_GPUS=2 on a two-GPU runner" in message
    assert "unset it" in message


def test_unset_a_missing_lane_skips_with_its_reason() -> None:
    """Without the variable the lane skips, with the reason a user acts on."""
    assert ("skip", "needs 2 CUDA devices, found 0") == lane_verdict("gpu2", 2, "needs 2 CUDA devices, found 0",
                                                                    None, 0)


def test_required_two_on_a_machine_without_gpus_fails_the_gpu2_lane() -> None:
    """HARNESS_REQUIRE_GPUS=2 with 0 devices: the gpu2 lane fails, with the message naming variable, count and fix."""
    assert ("fail", GPU2_MESSAGE) == lane_verdict("gpu2", 2, "needs 2 CUDA devices, found 0", 2, 0)


def test_required_two_fails_the_one_device_lane_too() -> None:
    """A lane needing fewer devices than required is required as well."""
    verdict, message = lane_verdict("gpu", 1, "needs 1 CUDA device, found 0", 2, 0)
    assert "fail" == verdict
    assert message.startswith("HARNESS_REQUIRE_GPUS=2 but this machine has 0 CUDA devices: the gpu lane")


def test_a_lane_needing_more_devices_than_required_still_skips() -> None:
    """HARNESS_REQUIRE_GPUS=1 on a one-GPU runner: the gpu2 lane skips with its reason."""
    assert ("skip", "needs 2 CUDA devices, found 1") == lane_verdict("gpu2", 2, "needs 2 CUDA devices, found 1", 1, 1)


def test_enough_devices_without_nccl_fails_a_required_lane_naming_nccl() -> None:
    """Two devices but no NCCL: the lane cannot run, so a required lane fails, and the message says why."""
    verdict, message = lane_verdict("gpu2", 2, "needs torch.distributed with NCCL, this torch build has none", 2, 2)
    assert "fail" == verdict
    assert "HARNESS_REQUIRE_GPUS=2 but the lane needs torch.distributed with NCCL" in message


def test_a_lane_that_can_run_runs_whatever_the_requirement() -> None:
    """Nothing missing: run, required or not."""
    assert ("run", "") == lane_verdict("gpu2", 2, "", 2, 2)
    assert ("run", "") == lane_verdict("gpu2", 2, "", None, 2)


# ------------------------------------------------------------------------------------------- through pytest itself

LANE_TESTS = '''
from harness.testing.skips import requires_two_gpus

@requires_two_gpus
def test_on_two_gpus():
    pass
'''


def _pytest(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess[str]:
    """Run a one-test gpu2 module in a fresh pytest with CUDA hidden and ``HARNESS_REQUIRE_GPUS`` set to ``require``."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["harness.testing.plugin"]\n')
    (tmp_path / "test_lane.py").write_text(LANE_TESTS)
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_GPUS_ENV}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    if require is not None:
        env[REQUIRE_GPUS_ENV] = require
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q", str(tmp_path / "test_lane.py")]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_pytest_without_the_variable_skips_the_lane_with_its_reason(tmp_path: Path) -> None:
    """Unset: the gpu2 test is skipped with "needs 2 CUDA devices, found 0", and the run passes."""
    done = _pytest(tmp_path, None)
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "1 skipped" in done.stdout
    assert "needs 2 CUDA devices, found 0" in done.stdout


@pytest.mark.slow
def test_pytest_with_the_variable_fails_the_lane_with_the_message(tmp_path: Path) -> None:
    """HARNESS_REQUIRE_GPUS=2 on a machine with 0 visible devices: the gpu2 test fails at setup, before any fixture
    starts ranks (pytest counts it as an error), and the run fails."""
    done = _pytest(tmp_path, "2")
    assert 1 == done.returncode, done.stdout + done.stderr
    assert "1 error" in done.stdout
    assert "skipped" not in done.stdout
    assert GPU2_MESSAGE in done.stdout


def test_pytest_with_a_bad_value_is_a_usage_error(tmp_path: Path) -> None:
    """HARNESS_REQUIRE_GPUS=two: pytest stops with a usage error (exit 4) naming the variable, the value and the fix."""
    done = _pytest(tmp_path, "two")
    assert 4 == done.returncode, done.stdout + done.stderr
    assert "HARNESS_REQUIRE_GPUS='two' is not a positive integer" in done.stderr
    assert "unset it" in done.stderr
