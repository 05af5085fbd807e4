"""The audit of a training script as a test: ``pytest --pyargs harness.audit --audit-command="torchrun
--nproc-per-node 2 train.py --its-args"`` runs ``python -m harness audit [--audit-options] -- <the command>`` from the
directory pytest was started in, and passes when the command exits 0 (every audited window's gradient is the
single-device reference's). A failure carries the verdict: parity per window and rank, the reading and its fix, or why
the script was not judged, with the last lines of its output.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

pytestmark = pytest.mark.audit

TAIL = 40
"""Lines of the script's output a failure shows."""


def test_the_script_optimizes_its_declared_objective(request: pytest.FixtureRequest) -> None:
    command = request.config.getoption("audit_command")
    if not command:
        pytest.skip("no --audit-command: give the training script's command as you run it, e.g. "
                    '--audit-command="torchrun --nproc-per-node 2 train.py"')
    options = shlex.split(request.config.getoption("audit_options") or "")
    deadline = float(options[options.index("--deadline") + 1]) if "--deadline" in options[:-1] else 600.0
    done = subprocess.run([sys.executable, "-m", "harness", "audit", *options, "--", *shlex.split(command)],
                          cwd=request.config.invocation_params.dir, capture_output=True, text=True, check=False,
                          timeout=deadline + 60)
    output = "\n".join(done.stderr.rstrip().splitlines()[-TAIL:])
    if done.returncode == 2:
        pytest.fail(f"usage error: {done.stderr.strip()}", pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"{done.stdout.rstrip()}\n\nthe script's output (last lines):\n{output}", pytrace=False)
