"""The installed battery on a user's own package in another directory: their model (BatchNorm, a head the loss never
uses, a parameter unused on some ranks), their correct step, their step with weight decay written into it, and their
model with a fused activation whose backward is wrong.

Both surfaces: ``pytest --pyargs harness.battery`` and ``python -m harness battery``, from the user's directory, with
nothing of this checkout on the path but the installed package.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

installed = any(ep.value == "harness.testing.plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
requires_installed_plugin = pytest.mark.skipif(
    not installed, reason="needs the package installed (pip install -e .) so its pytest11 entry point is registered"
)

PROJECT = {
    "mymodels.py": '''
        import torch
        from torch import nn


        class Net(nn.Module):
            """Embedding, a causal running mean, BatchNorm over channels, a routed expert for long rows, an LM head,
            and a classifier head the LM loss never calls."""

            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(32, 24)
                self.bn = nn.BatchNorm1d(24)
                self.long_expert = nn.Linear(24, 24)
                self.lm_head = nn.Linear(24, 32)
                self.cls_head = nn.Linear(24, 3)

            def forward(self, input_ids, attention_mask=None):
                x = self.emb(input_ids)
                steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device).view(1, -1, 1)
                x = torch.cumsum(x, 1) / steps
                x = self.bn(x.transpose(1, 2)).transpose(1, 2)
                long = (input_ids != 0).sum(1) > 100
                if bool(long.any()):
                    x = x.clone()
                    x[long] = x[long] + torch.tanh(self.long_expert(x[long]))
                return self.lm_head(x)


        def make():
            return Net()
        ''',
    "mysteps.py": '''
        import contextlib

        import torch
        import torch.distributed as dist
        import torch.nn.functional as F


        class Step:
            name = "my_step"
            decay = 0.0

            def backward_window(self, model, window):
                n = torch.tensor(sum(int((mb.labels != -100).sum()) for mb in window))
                dist.all_reduce(n)
                if int(n) == 0:
                    raise ValueError("nothing to learn from in this window")
                scale = dist.get_world_size() / int(n)
                for i, mb in enumerate(window):
                    ctx = model.no_sync() if i + 1 < len(window) else contextlib.nullcontext()
                    with ctx:
                        logits = model(mb.inputs)
                        loss = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=-100,
                                               reduction="sum")
                        (loss * scale).backward()
                if self.decay:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(1 - self.decay)


        class StepWithDecay(Step):
            name = "my_step_with_decay"
            decay = 1e-4


        step = Step()
        step_with_decay = StepWithDecay()
        ''',
    "myfused.py": '''
        import torch
        from torch import nn


        class FusedGelu(torch.autograd.Function):
            """A fused tanh-GELU whose backward is missing the tanh term's chain rule."""

            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))

            @staticmethod
            def backward(ctx, grad):
                (x,) = ctx.saved_tensors
                return grad * 0.5 * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


        class Mlp(nn.Module):
            def __init__(self):
                super().__init__()
                self.up = nn.Linear(24, 48)
                self.down = nn.Linear(48, 24)

            def forward(self, x):
                return self.down(FusedGelu.apply(self.up(x)))


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(32, 24)
                self.mlp = Mlp()
                self.lm_head = nn.Linear(24, 32)

            def forward(self, input_ids, attention_mask=None):
                x = torch.cumsum(self.emb(input_ids), 1)
                return self.lm_head(x + self.mlp(x))


        def make():
            return Net()
        ''',
}


def _project(tmp_path: Path) -> Path:
    user = tmp_path / "userproject"
    user.mkdir()
    for name, text in PROJECT.items():
        (user / name).write_text(textwrap.dedent(text).lstrip())
    return user


def _run(user: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=user, env={**os.environ, "PYTHONPATH": str(user)},
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@requires_installed_plugin
def test_the_installed_battery_passes_a_users_step_on_their_model_and_names_the_models_properties(
    tmp_path: Path
) -> None:
    """pytest and the command line: every check holds or is n/a; the notes name the unused head and the routed
    expert as the model's, with find_unused_parameters turned on; BatchNorm's refused shape stays out of the drawn
    layouts."""
    user = _project(tmp_path)
    report = tmp_path / "pytest.json"
    done = _run(user, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "harness.battery", "-q",
                "--recipe=mysteps:step", "--model=mymodels:make", "--battery-world-sizes=2,3", "--precision=fp32",
                "--battery-examples=4", f"--battery-report={report}")
    assert 0 == done.returncode, done.stdout[-4000:] + done.stderr[-4000:]
    data = json.loads(report.read_text())
    assert "fail" not in {c["status"] for c in data["checks"]}
    notes = {n for c in data["checks"] for n in c["notes"]}
    assert any("cls_head.weight" in n and "no gradient" in n for n in notes)
    assert any("long_expert.weight" in n and "missing on rank 0" in n for n in notes)
    out = tmp_path / "cli.json"
    cli = _run(user, "-m", "harness", "battery", "--recipe", "mysteps:step", "--model", "mymodels:make",
               "--battery-world-sizes", "2", "--precision", "fp32", "--battery-examples", "2",
               "--battery-report", str(out))
    assert 0 == cli.returncode, cli.stdout[-4000:] + cli.stderr[-4000:]
    assert "about the model mymodels:make" in cli.stdout and "find_unused_parameters=True" in cli.stdout
    assert any("Expected more than 1 value per channel" in n for n in json.loads(out.read_text())["model_notes"])


@pytest.mark.slow
@requires_installed_plugin
def test_the_installed_battery_fails_a_users_step_that_decays_the_weights_in_place(tmp_path: Path) -> None:
    """The same step with an in-place weight decay fails weights_unchanged by name, from the user's directory."""
    user = _project(tmp_path)
    done = _run(user, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "harness.battery", "-q",
                "--recipe=mysteps:step_with_decay", "--model=mymodels:make", "--battery-world-sizes=2",
                "--precision=fp32", "--battery-examples=0", "-k", "bitwise_unchanged and uneven")
    assert 1 == done.returncode, done.stdout[-4000:] + done.stderr[-4000:]
    assert "check weights_unchanged FAILED" in done.stdout and "lm_head.weight" in done.stdout


@pytest.mark.slow
@requires_installed_plugin
def test_the_installed_battery_refuses_a_users_model_whose_fused_activation_has_a_wrong_backward(
    tmp_path: Path
) -> None:
    """From the user's directory: exit 2 before any rank, naming the model, the module ``mlp`` and the Function."""
    user = _project(tmp_path)
    cli = _run(user, "-m", "harness", "battery", "--recipe", "mysteps:step", "--model", "myfused:make")
    assert 2 == cli.returncode, cli.stdout[-4000:] + cli.stderr[-4000:]
    assert "--model: model='myfused:make': the model's backward is not the gradient of its forward" in cli.stderr
    assert "module mlp (Mlp)" in cli.stderr and "myfused.FusedGelu" in cli.stderr
