"""Battery jobs under torchrun (``python -m harness.battery.dist``) started the way a CI job starts them: ``nodes``
torchrun agents on 127.0.0.1 with ``per_node`` workers each, one c10d rendezvous, each agent under ``timeout -k`` so
nothing outlives the test. Used by ``tests/distributed/test_torchrun_battery.py`` and the GPU lanes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from support.ports import HOST, free_port, port_taken

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
JOB_TIMEOUT = 240
"""Seconds one job may take (rendezvous, the battery, the agents' exit) before ``timeout`` kills it."""


def job(tmp_path: Path, *args: str, nodes: int = 2, per_node: int = 2,
        env: dict[str, str] | None = None) -> tuple[list[int], str, dict[str, Any] | None]:
    """Start the job; return the agents' exit statuses, their output, and rank 0's JSON report (None where none was
    written). A port taken before torchrun bound it is retried on a new one."""
    report = tmp_path / f"report-{uuid.uuid4().hex[:6]}.json"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RANK", "WORLD_SIZE", "MASTER_"))}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), base.get("PYTHONPATH", "")])
    base.update(env or {})
    text, agents = "", []
    for _ in range(3):
        port, run_id = free_port(), uuid.uuid4().hex[:8]
        cmd = [TORCHRUN, f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={HOST}:{port}", f"--rdzv-id={run_id}", f"--local-addr={HOST}", "--max-restarts=0",
               "-m", "harness.battery.dist", *args, "--battery-report", str(report)]
        agents = [subprocess.Popen(["timeout", "-k", "5", str(JOB_TIMEOUT), *cmd], cwd=tmp_path, env=base,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for _ in range(nodes)]
        text = "\n".join(a.communicate(timeout=JOB_TIMEOUT + 30)[0] for a in agents)
        if not port_taken(text):
            break
    codes = [a.returncode for a in agents]
    assert 124 not in codes and -9 not in codes, f"a job outlived {JOB_TIMEOUT} s:\n{text[-3000:]}"
    return codes, text, json.loads(report.read_text()) if report.exists() else None


__all__ = ["JOB_TIMEOUT", "job"]
