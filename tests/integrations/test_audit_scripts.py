"""``python -m harness audit`` on a transformers ``Trainer`` script (tests/scripts/trainer_train.py: a Llama from a
config, a padding collator, two microbatches of accumulation), not one line changed, under torchrun with two gloo
ranks: the script as the documentation writes it exits 0; ``average_tokens_across_devices=False`` exits 1 with the
mean-of-local-means reading and its fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the integrations lane: bash scripts/integrations.sh")

pytestmark = pytest.mark.integrations

SCRIPT = Path(__file__).parents[1] / "scripts" / "trainer_train.py"


@pytest.mark.parametrize(("extra", "status", "said"), [
    ((), 0, "every audited window's gradient is the reference's"),
    (("--local-average",), 1, "reading (mean_of_local_means)"),
])
def test_a_trainer_script_is_judged_as_it_runs(tmp_path: Path, extra: tuple[str, ...], status: int, said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "harness", "audit", "--", sys.executable, "-m",
                           "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT), *extra],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert status == done.returncode, done.stdout + done.stderr
    assert said in done.stdout, done.stdout
    assert 4 == done.stdout.count("parity "), done.stdout
