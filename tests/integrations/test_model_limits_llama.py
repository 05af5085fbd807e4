"""The model probe's readings of what the battery feeds (:mod:`harness.battery.prepare.probe.model_limits`) on a
transformers Llama built from a config (no weights downloaded): a model the battery can feed gets none of them."""

from __future__ import annotations

import pytest

from harness.battery.prepare.probe.facts import probe
from harness.recipes.libraries._common import EXTRA_HINT

pytestmark = pytest.mark.integrations


@pytest.mark.parametrize("batch_format", ["hf", "harness"])
def test_a_transformers_llama_from_a_config_gets_no_reading_of_what_the_battery_feeds(batch_format: str) -> None:
    """Every position's logits over the battery's vocabulary, 128 positions, and a loss that ignores -100 when it is
    given labels: no refusal, no note about positions, vocabulary, block size or ignore index."""
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    found = probe("integrations.hf_models:tiny_llama", batch_format)
    assert found.max_len is None and found.label_loss is None
    readings = ("positions: the battery calls", "vocab_size >=", "block_size", "map the ignore index")
    assert not [n for n in found.notes() if any(r in n for r in readings)]
