"""The model probe's backward check on real transformers models built from a config (no weights downloaded): their
backward is the gradient of their forward within the bound, in both batch formats."""

from __future__ import annotations

import pytest

from harness.battery.prepare.probe.facts import probe
from harness.recipes.libraries._common import EXTRA_HINT

pytestmark = pytest.mark.integrations


@pytest.mark.parametrize("batch_format", ["hf", "harness"])
def test_a_transformers_llama_from_a_config_passes_the_backward_check(batch_format: str) -> None:
    """Two Llama layers in float64: every random direction within its bound, no note about the backward."""
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    found = probe("integrations.hf_models:tiny_llama", batch_format)
    assert found.backward is not None and "torch.float64" == found.backward.dtype
    assert not found.backward.disagrees and all(d.agrees for d in found.backward.directions)
    assert not [n for n in found.notes() if "backward" in n]
