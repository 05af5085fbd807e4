"""The packing probe on a real transformers Llama built from a config (no weights downloaded): FACTS' finding that it
keeps packed sequences apart only with ``use_cache=False``."""

from __future__ import annotations

import pytest

from harness.battery.spec import ModelSpec
from harness.diagnosis.packing import packing_gap
from harness.recipes.libraries._common import EXTRA_HINT

pytestmark = pytest.mark.integrations


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_a_llama_crosses_packed_boundaries_with_use_cache_on_and_not_with_it_off(precision: str) -> None:
    """Llama's default config.use_cache=True builds no block-diagonal mask from position_ids: the probe reports it,
    with use_cache=False in the fix; with use_cache=False the packed logits are the unpacked ones."""
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    model = ModelSpec("integrations.hf_models:tiny_llama", precision=precision).build()
    assert model.config.use_cache
    found = packing_gap(model)
    assert found.gap > 1e-2 and "use_cache=False" in str(found.note())
    model.config.use_cache = False
    fixed = packing_gap(model)
    assert fixed.gap < (1e-12 if precision == "fp64" else fixed.tolerance) and fixed.note() is None
