"""A transformers Llama built from a config (no weights downloaded) under ``--batch-format packed``: the packed call
(:func:`harness.core.formats.hf_forward`: position_ids, no attention mask, ``use_cache=False``, the flash kwargs
through ``**kwargs``) gives the loss of the same sequences unpacked; with the model's default cache it does not."""

from __future__ import annotations

import pytest
import torch

from harness.battery import scenarios
from harness.battery.prepare.probe.facts import probe
from harness.battery.spec import ModelSpec
from harness.core.formats import FLASH_KEYS, hf_forward, logits_of, packed_kwargs, shifted_loss_sum, to_packed
from harness.recipes.libraries._common import EXTRA_HINT

pytestmark = pytest.mark.integrations


def test_a_transformers_llama_gives_the_unpacked_loss_on_packed_rows() -> None:
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    spec = ModelSpec("integrations.hf_models:tiny_llama", "packed", None, "fp64")
    model = spec.build()
    probe(spec.path, "packed")  # the packed call is part of the model probe
    with torch.no_grad():
        for mb in scenarios.build("uneven", 2)[0][1]:
            packed = to_packed(mb)
            assert {"use_cache", *FLASH_KEYS} <= set(packed_kwargs(model, packed))
            want = spec.loss_sum(model, mb)
            assert float((shifted_loss_sum(hf_forward(model, packed), packed["labels"]) - want).abs()) < 1e-9
            # the negative control: the default use_cache (True) builds no block-diagonal mask
            cached = logits_of(model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]))
            assert float((shifted_loss_sum(cached, packed["labels"]) - want).abs()) > 1e-3
