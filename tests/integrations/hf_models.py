"""A small, randomly initialized transformers causal LM for the battery's ``--model`` (no weights are downloaded):
``--model=integrations.hf_models:tiny_llama`` with ``--batch-format hf``."""

from __future__ import annotations

from torch import nn


def tiny_llama() -> nn.Module:
    """``LlamaForCausalLM`` from a config: two layers of width 32, the battery config's vocabulary; its weights come
    from torch's global generator, which the harness seeds before the call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.battery.scenarios import BATTERY_CONFIG

    config = LlamaConfig(vocab_size=BATTERY_CONFIG.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, attention_dropout=0.0, pad_token_id=0)
    return LlamaForCausalLM(config)
