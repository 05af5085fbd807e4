"""The installed battery checks a user's transformers training step from the user's own repository:
``pytest --pyargs harness.battery --recipe=... --model=... --batch-format=hf`` run in a directory outside this
checkout, on a package written there the way a user writes it (transformers' model loss with ``num_items_in_batch``,
a randomly initialized ``LlamaForCausalLM`` built from a config, nothing downloaded).

The Trainer's step with the gathered count passes every check at W=2 in float32; the same step with each rank's own
count (``average_tokens_across_devices=False``) exits 1 and its parity failures name ``mean_of_local_means``. World
size 2, float32 and two drawn layouts keep the lane short: the two runs took 26 s together on a 2-core machine (33 s
and 12 s run by hand, the first with a cold import of transformers)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.recipes.libraries._common import EXTRA_HINT

pytestmark = pytest.mark.integrations

installed = any(ep.value == "harness.testing.plugin" for ep in importlib.metadata.entry_points(group="pytest11"))

MODEL = '''
"""A tiny Llama for the parity check: built from a config, randomly initialized, nothing downloaded."""

from transformers import LlamaConfig, LlamaForCausalLM


def tiny():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attention_dropout=0.0, pad_token_id=0)
    return LlamaForCausalLM(config)
'''

TRAIN_STEP = '''
"""This project's training step: Hugging Face batches, the model's own loss with num_items_in_batch, as
transformers' Trainer computes it."""

import contextlib

import torch
import torch.distributed as dist


class TrainStep:
    name = "userproj_train_step"

    def __init__(self, average_tokens_across_devices=True):
        self.average_tokens_across_devices = average_tokens_across_devices

    def backward_window(self, model, window):
        world = dist.get_world_size() if dist.is_initialized() else 1
        device = next(model.parameters()).device
        # The tokens the loss averages over: labels are unshifted, the model shifts them by one.
        local = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in window)
        total = torch.tensor(local, dtype=torch.int64, device=device)
        if world > 1:
            dist.all_reduce(total)
        if int(total) == 0:
            raise ValueError("no supervised token in this window on any rank")
        if self.average_tokens_across_devices:
            num_items, factor = total, world  # DDP averages the ranks' gradients: multiply by the world size
        else:
            num_items, factor = torch.tensor(local, dtype=torch.int64, device=device), 1
        logged = torch.zeros((), dtype=torch.float64, device=device)
        for i, batch in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(**batch, num_items_in_batch=num_items).loss * factor
                loss.backward()
            logged += loss.detach().double()
        if world > 1:
            dist.all_reduce(logged)
        return float(logged) / world


step = TrainStep()
local_items_step = TrainStep(average_tokens_across_devices=False)
'''


@pytest.fixture(scope="module")
def user_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``userproj/`` (model.py, train_step.py) in a directory outside this checkout."""
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    if not installed:
        pytest.skip("needs the package installed (pip install -e .) so its pytest11 entry point is registered")
    root = tmp_path_factory.mktemp("userproject")
    package = root / "userproj"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(textwrap.dedent(MODEL).lstrip())
    (package / "train_step.py").write_text(textwrap.dedent(TRAIN_STEP).lstrip())
    return root


def _battery(root: Path, recipe: str, report: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "harness.battery", f"--recipe={recipe}",
         "--model=userproj.model:tiny", "--batch-format=hf", "-p", "no:cacheprovider", "-q",
         "--battery-world-sizes", "2", "--precision", "fp32", "--battery-examples", "2", f"--battery-report={report}"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )


def test_a_users_trainer_step_on_a_transformers_model_passes_from_its_own_repository(user_project: Path) -> None:
    report = user_project / "report.json"
    done = _battery(user_project, "userproj.train_step:step", report)
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(report.read_text())
    assert ("userproj.model:tiny", "hf", 0) == (data["model"], data["batch_format"], data["exit_status"])
    assert data["expected"] == data["run"] == data["counts"]["pass"] + data["counts"]["n/a"], data["counts"]
    assert data["counts"]["pass"] > 0
    # What does not apply: the clipping check (this step does not clip), never a check that could have failed.
    assert {"clipping"} >= {c["check"] for c in data["checks"] if c["status"] == "n/a"}
    assert 0 == data["counts"]["fail"] and [] == data["errors"]


def test_a_users_step_with_each_ranks_own_count_fails_naming_the_mean_of_local_means(user_project: Path) -> None:
    """``average_tokens_across_devices=False``: each rank's own ``num_items_in_batch``, no world-size factor."""
    report = user_project / "report-local.json"
    done = _battery(user_project, "userproj.train_step:local_items_step", report)
    assert 1 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    assert "diagnosis (mean_of_local_means): " in done.stdout, done.stdout[-3000:]
    data = json.loads(report.read_text())
    uneven = [c for c in data["checks"] if (c["check"], c["scenario"]) == ("parity", "uneven")]
    assert ["fail"] == [c["status"] for c in uneven]
    assert "mean_of_local_means" == uneven[0]["diagnosis"]["signature"]
