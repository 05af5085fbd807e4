"""Activation checkpointing in the model (seed 004): gradients unchanged within tolerance, and fewer bytes kept for
backward, measured with ``torch.autograd.graph.saved_tensors_hooks`` (called for every tensor autograd saves); and
a reentrant checkpoint whose inputs need no gradient named as what drops its parameters' gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.battery.prepare.probe.facts import probe_model
from harness.battery.spec import ModelSpec
from harness.core.loss import loss_sum
from harness.data.batching import collate
from harness.data.config import Config
from harness.data.corpus import Row
from harness.model import build_model

# Four blocks, 64 positions: enough activations inside the blocks for checkpointing to matter.
CONFIG = Config(d_model=32, n_heads=2, n_layers=4, vocab_size=32, max_len=64, min_len=8, prompt_max=4, dropout=0.0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    rows = [Row(i, "train", tuple(1 + (3 * i + 5 * t) % 31 for t in range(64 - i)), 2 * (i % 2)) for i in range(4)]
    mb = collate(rows)
    return mb.inputs, mb.labels


def _model(checkpointing: bool, seed: int | None = None) -> nn.Module:
    return build_model(CONFIG, seed=seed, activation_checkpointing=checkpointing).train()


def _saved_bytes_and_grad(model: nn.Module) -> tuple[int, torch.Tensor]:
    """Bytes of every tensor saved for backward during one forward, and the flat gradient of the loss sum."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    inputs, labels = _batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_sum(model(inputs), labels)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return saved, grad


def test_checkpointing_leaves_the_gradient_unchanged() -> None:
    """The recomputed forward gives the same gradient as the stored one (dropout 0, deterministic kernels)."""
    _, plain = _saved_bytes_and_grad(_model(False))
    _, ckpt = _saved_bytes_and_grad(_model(True))
    # Recomputation runs the same kernels on the same inputs; the tolerance only absorbs float32 summation order.
    torch.testing.assert_close(ckpt, plain, atol=1e-6, rtol=1e-5)


def test_the_gradient_comparison_rejects_another_model() -> None:
    """Negative control: the same comparison tells a model with other weights apart."""
    _, plain = _saved_bytes_and_grad(_model(False))
    _, other = _saved_bytes_and_grad(_model(True, seed=CONFIG.seed + 1))
    assert not torch.allclose(other, plain, atol=1e-6, rtol=1e-5)


def test_checkpointing_keeps_fewer_bytes_for_backward() -> None:
    """With checkpointing only each block's input is kept; the measured saved bytes drop by at least half."""
    plain, _ = _saved_bytes_and_grad(_model(False))
    ckpt, _ = _saved_bytes_and_grad(_model(True))
    assert ckpt * 2 <= plain, f"saved for backward: {ckpt} bytes with checkpointing, {plain} without"


def test_the_byte_measurement_sees_checkpointing_switched_off_in_eval_mode() -> None:
    """Negative control: the model checkpoints only in train mode, and in eval mode (gradients still on) the
    measurement reports the full bytes again."""
    plain, _ = _saved_bytes_and_grad(_model(False))
    off, _ = _saved_bytes_and_grad(_model(True).eval())
    assert plain == off


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the model's own warning, and true
def test_a_reentrant_checkpoint_whose_inputs_need_no_gradient_is_named_as_what_drops_18_gradients() -> None:
    """Frozen embeddings feed three blocks under use_reentrant=True: the forward uses the blocks' 18 parameters, and
    the probe names the checkpoint (around blocks.0-2) as the cause, with the fix, never "no forward reaches"."""
    found = probe_model(ModelSpec("user_recipes.backward_models:FrozenEmbeddingCheckpointed"))
    assert 18 == len(found.unused)
    assert {"checkpoint"} == {g.cause for g in found.gradless}
    (note, remedy) = found.notes()
    assert "find_unused_parameters=True" in remedy
    assert "inside a reentrant activation checkpoint" in note and "around blocks.0, blocks.1, blocks.2" in note
    assert "use_reentrant=False" in note and "no forward reaches" not in note


def test_the_same_blocks_under_a_non_reentrant_checkpoint_all_get_their_gradient() -> None:
    """The control: use_reentrant=False recomputes through the parameters themselves, so nothing is missing."""
    found = probe_model(ModelSpec("user_recipes.backward_models:FrozenEmbeddingCheckpointedRight"))
    assert () == found.unused == found.gradless and () == found.notes()
