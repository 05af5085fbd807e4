"""transformers models honour a packed batch (``DataCollatorWithFlattening``) only with ``use_cache=False`` and no
attention mask: measured on a Llama and a GPT-2 built from configs in float64, on the eager and sdpa paths, against
the padded batch (``tests/integrations/packing.py`` says how). With the config's default ``use_cache`` (True, in
train mode too) or an all-ones attention mask the model builds no block-diagonal mask and each sequence attends to
the ones packed before it: logits off by 5.7e-2 (GPT-2) and 1.8e-1 (Llama), and the loss with them
(``benchmarks/results/packing.json``). A release that changes any of this fails here and in the table's rows.

flex_attention is in the table only (``python benchmarks/packing_table.py``): GPT-2 refuses it, and Llama's CPU kernel
refuses float64 after some seconds of compiling. The module measures each model once (about 10 s with the imports).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from integrations import packing

from harness.recipes.libraries._common import EXTRA_HINT

pytestmark = pytest.mark.integrations

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "packing.json"
PATHS = [(m, i) for m in packing.MODELS for i in ("eager", "sdpa")]
Key = tuple[str, str, Any, str, bool]


@pytest.fixture(scope="module")
def readings() -> dict[Key, packing.Reading]:
    """Every (model, implementation, use_cache, mask, flash kwargs) reading on the eager and sdpa paths."""
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    out = {}
    for model, implementation in PATHS:
        for r in packing.measure(model, implementation)[0]:
            out[(model, implementation, r.use_cache, r.mask, r.flash_kwargs)] = r
    return out


def _line(r: packing.Reading) -> str:
    return (f"{r.model} {r.attn_implementation} use_cache={r.use_cache} mask={r.mask} flash_kwargs={r.flash_kwargs}: "
            f"logits {r.logits_error}, loss {r.loss_error} (bar {r.bar}, loss bar {packing.LOSS_BAR}), {r.error}")


@pytest.mark.parametrize(("model", "implementation"), PATHS, ids=[f"{m}-{i}" for m, i in PATHS])
def test_packing_is_honoured_with_use_cache_false_and_no_mask(readings: dict[Key, packing.Reading], model: str,
                                                              implementation: str) -> None:
    """use_cache=False without a mask matches the padded batch, logits and loss, with or without the flash kwargs."""
    for flash in (False, True):
        r = readings[(model, implementation, False, "none", flash)]
        assert r.honours is True, _line(r)


@pytest.mark.parametrize(("model", "implementation"), PATHS, ids=[f"{m}-{i}" for m, i in PATHS])
@pytest.mark.parametrize(("use_cache", "mask"), [("default", "none"), ("default", "ones"), (False, "ones")],
                         ids=["default_cache", "default_cache-ones_mask", "ones_mask"])
def test_the_default_cache_or_an_all_ones_mask_crosses_boundaries(readings: dict[Key, packing.Reading], model: str,
                                                                  implementation: str, use_cache: Any,
                                                                  mask: str) -> None:
    """The negative twin: the default use_cache or an all-ones mask lets sequences attend across their boundaries,
    by far more than the bar, in the logits and in the loss."""
    for flash in (False, True):
        r = readings[(model, implementation, use_cache, mask, flash)]
        assert r.honours is False, _line(r)
        assert r.logits_error is not None and r.logits_error > 1e3 * r.bar, _line(r)
        assert r.loss_error is not None and r.loss_error > 1e2 * packing.LOSS_BAR, _line(r)


def test_the_flash_kwargs_change_nothing_on_these_paths(readings: dict[Key, packing.Reading]) -> None:
    """cu_seq_lens, max_length and seq_idx are read by flash attention only: eager and sdpa give the same errors."""
    differ = []
    for (model, implementation, use_cache, mask, flash), r in readings.items():
        plain = readings[(model, implementation, use_cache, mask, False)]
        if flash and (r.logits_error, r.loss_error) != (plain.logits_error, plain.loss_error):
            differ.append(_line(r))
    assert [] == differ


def stale(readings: dict[Key, packing.Reading], rows: list[dict[str, Any]]) -> list[str]:
    """The measured readings whose float64 row in ``rows`` (packing.json's) gives another verdict, or is missing."""
    table = {(r["model"], r["attn_implementation"], r["use_cache"], r["mask"], r["flash_kwargs"]): r
             for r in rows if r["dtype"] == "float64"}
    return [f"{_line(r)}: the table says honours={table[k]['honours'] if k in table else 'nothing'}"
            for k, r in readings.items() if k not in table or table[k]["honours"] != r.honours]


def test_packing_json_holds_the_measured_verdicts(readings: dict[Key, packing.Reading]) -> None:
    """benchmarks/results/packing.json (docs/libraries.md's table) says what this transformers measures."""
    import transformers

    result = json.loads(RESULTS.read_text())
    assert [] == stale(readings, result["rows"]), (
        f"measured with transformers {transformers.__version__}, the table with "
        f"{result['versions']['transformers']}: run python benchmarks/packing_table.py")


def test_a_flipped_verdict_in_the_table_is_reported(readings: dict[Key, packing.Reading]) -> None:
    """Negative control: packing.json with one honouring row turned into a crossing one, or dropped, is stale."""
    rows = json.loads(RESULTS.read_text())["rows"]
    first = next(i for i, r in enumerate(rows) if r["honours"] is True and r["dtype"] == "float64")
    flipped = [dict(r, honours=False) if i == first else r for i, r in enumerate(rows)]
    assert 1 == len(stale(readings, flipped))
    assert 1 == len(stale(readings, rows[:first] + rows[first + 1:]))


def test_gpt2_refuses_flex_attention() -> None:
    """GPT-2 has no flex_attention path: building it with one raises, naming the architecture."""
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel does not support .* flex_attention"):
        packing.build("gpt2", "flex_attention")


def test_an_unknown_model_is_refused_with_the_choices() -> None:
    """build() names the bad model and the ones it knows."""
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    with pytest.raises(ValueError, match=r"model='bert' is not one of \('llama', 'gpt2'\)"):
        packing.build("bert", "sdpa")
