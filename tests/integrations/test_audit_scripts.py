"""``python -m harness audit`` on scripts written against the libraries, not one line changed, under torchrun with two
gloo ranks, each a Llama from a config with a padding collator and two microbatches of accumulation:

- a transformers ``Trainer`` script (tests/scripts/trainer_train.py): as its documentation writes it, it exits 0;
  ``average_tokens_across_devices=False`` exits 1 with the mean-of-local-means reading and its fix;
- an accelerate ``accumulate`` script (tests/scripts/accelerate_train.py): the loss sum over the gathered token count
  exits 0; ``backward(out.loss)`` as the guide shows exits 1 with the per-microbatch-mean reading."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the integrations lane: bash scripts/integrations.sh")

pytestmark = pytest.mark.integrations

SCRIPTS = Path(__file__).parents[1] / "scripts"


@pytest.mark.parametrize(("script", "extra", "status", "said"), [
    ("trainer_train.py", (), 0, "every audited window's gradient is the reference's"),
    ("trainer_train.py", ("--local-average",), 1, "reading (mean_of_local_means)"),
    ("accelerate_train.py", (), 0, "every audited window's gradient is the reference's"),
    ("accelerate_train.py", ("--as-documented",), 1, "reading (per_microbatch_mean)"),
])
def test_a_library_script_is_judged_as_it_runs(tmp_path: Path, script: str, extra: tuple[str, ...], status: int,
                                               said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "harness", "audit", "--", sys.executable, "-m",
                           "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPTS / script), *extra],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert status == done.returncode, done.stdout + done.stderr
    assert said in done.stdout, done.stdout
    assert 4 == done.stdout.count("parity "), done.stdout
