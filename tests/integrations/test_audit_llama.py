"""The in-code audit on transformers' own Llama, built from a config, in a plain accumulation loop that nobody wrote
for the harness: the model computes its loss from the labels it is given (its mean over the shifted tokens). The
loop that weighs each microbatch's mean by its share of the window's tokens passes; the one that divides each mean
by the accumulation steps reads per_microbatch_mean, with its fix."""

from __future__ import annotations

import pytest
import torch
from support.audit_models import accumulate

from harness.audit import watch
from harness.core.microbatch import IGNORE_INDEX

transformers = pytest.importorskip("transformers", reason="the integrations lane: bash scripts/integrations.sh")

pytestmark = pytest.mark.integrations


def tiny_llama() -> torch.nn.Module:
    """A two-layer Llama from a config, its weights drawn from seed 0 with the caller's generators kept."""
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)


def batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, 32, (n,), generator=g)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


@pytest.mark.parametrize("right", [True, False])
def test_a_llama_accumulation_loop_is_judged_as_it_runs(right: bool) -> None:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    windows = [[batch([12, 5], 1), batch([20, 16, 4], 2)]]
    with watch(windows=1) as audit:
        for mbs in windows:
            accumulate(model, opt, mbs, right)
    verdict = audit.verdict()
    assert verdict.passed is right, str(verdict)
    if not right:
        assert verdict.diagnosis is not None and "per_microbatch_mean" == verdict.diagnosis.signature.name
