"""What the battery feeds a model, checked before any rank starts (:mod:`harness.battery.prepare.probe.model_limits`):
each way a nanoGPT-shaped model stops on the battery's batches gets its one-line reading with the fix, a right model
gets none, and docs/your-model.md's numbers are the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from harness.battery import layouts, scenarios
from harness.battery.prepare.probe import facts, model_limits
from harness.core.formats import to_packed
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.model import ModelError
from harness.workflow.checks import BadInput, model_notes

DOC = Path(__file__).resolve().parents[2] / "docs" / "your-model.md"
READINGS = ("positions: the battery calls", "vocab_size >=", "block_size (max_position_embeddings) >=",
            "map the ignore index", "failed with")
"""A fragment of each reading, for the negative controls."""


def _refused(name: str, batch_format: str = "harness") -> str:
    with pytest.raises(ModelError) as raised:
        facts.probe(f"user_recipes.nanogpt:{name}", batch_format)
    return str(raised.value)


def _table() -> dict[str, int]:
    text = DOC.read_text()
    section = text.split("## What the battery feeds your model", 1)[1].split("\n## ", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^\| `(\w+)` \| (-?\d+) \|", section, flags=re.MULTILINE)}


def _code() -> dict[str, int]:
    return {**model_limits.feeds(), "drawn_min_len": layouts.SHORTEST_ROW, "drawn_max_rows": layouts.MAX_ROWS}


def test_the_docs_table_of_what_the_battery_feeds_is_the_codes() -> None:
    """Every number of "What the battery feeds your model" is the constant the code feeds, and every constant is
    there: a changed vocabulary or row length fails here until the page says it."""
    assert _code() == _table()


def test_the_table_check_rejects_a_stale_number() -> None:
    """Negative control: a page saying another vocabulary differs from the code's."""
    stale = {**_table(), "vocab_size": 64}
    assert _code() != stale


def test_the_docs_rows_per_scenario_are_the_scenarios_at_two_ranks() -> None:
    """Each scenario's rows, positions and packed widths at W=2, rebuilt from harness.battery.scenarios, are the
    page's table."""
    section = DOC.read_text().split("## What the battery feeds your model", 1)[1].split("\n## ", 1)[0]
    page = {m[1]: m.groups()[1:] for m in re.finditer(r"^  \| `(\w+)` \| (\d+-\d+) \| (\d+-\d+) \| (\d+-\d+) \| "
                                                     r"(\d+-\d+) \|", section, flags=re.MULTILINE)}
    built = {}
    for name in scenarios.BATTERY_SCENARIOS:
        mbs = [mb for window in scenarios.build(name, 2) for rank in window for mb in rank]
        rows, ts = [mb.inputs.shape[0] for mb in mbs], [mb.inputs.shape[1] for mb in mbs]
        widths = [to_packed(mb)["input_ids"].shape[1] for mb in mbs]
        built[name] = tuple(f"{min(v)}-{max(v)}" for v in (rows, ts, [t + 1 for t in ts], widths))
    assert built == page


def test_the_widest_packed_row_is_two_of_the_longest_sequences() -> None:
    """Two sequences of the longest length pack into one row of PACKED_WIDTH tokens (to_packed's capacity)."""
    n = model_limits.LONGEST_INPUT
    mb = Microbatch(torch.ones(2, n, dtype=torch.int64), torch.ones(2, n, dtype=torch.int64))
    assert (1, model_limits.PACKED_WIDTH) == tuple(to_packed(mb)["input_ids"].shape)


def test_nanogpt_returning_the_last_position_only_is_refused_with_the_fix() -> None:
    """nanoGPT's logits[:, [-1], :] without targets: one of eight positions, and the line to change."""
    assert ("model='user_recipes.nanogpt:nanogpt': returns logits for 1 of 8 positions (shape (2, 1, 32)): the battery "
            "calls model(inputs) and reads every position's logits [B, T, V]; make forward return them all when called "
            "without targets (nanoGPT: `logits = self.lm_head(x)` in both branches), or, to keep your model file as "
            "it is, have the --model factory return a subclass whose forward passes targets (nanoGPT: "
            "`super().forward(idx, torch.full_like(idx, -1))`)") == _refused("nanogpt")


def test_a_last_position_of_shape_b_v_is_read_as_one_position() -> None:
    """logits[:, -1, :] ([B, V]) is the same mistake."""
    assert "returns logits for 1 of 8 positions (shape (2, 32))" in _refused("LastPositionFlat")


def test_a_vocabulary_under_the_batterys_names_both_numbers_and_the_fix() -> None:
    """An embedding of 16 ids: the ids it takes, the battery's vocabulary, vocab_size >= 32."""
    assert ("model='user_recipes.nanogpt:small_vocab': its forward fails on the battery's token ids (IndexError: index "
            "out of range in self); it runs ids below 16, the battery feeds ids 1..31 of a vocabulary of 32 (0 is PAD; "
            "harness.battery.scenarios.BATTERY_CONFIG.vocab_size): build it with vocab_size >= 32"
            ) == _refused("small_vocab")


def test_logits_narrower_than_the_vocabulary_are_refused() -> None:
    """A head of 16 classes over an embedding of 32: the logits' width and the battery's vocabulary."""
    assert ("model='user_recipes.nanogpt:NarrowHead': its logits have 16 entries per position, under the battery's "
            "vocabulary of 32 (token ids 1..31; harness.battery.scenarios.BATTERY_CONFIG.vocab_size): build it with "
            "vocab_size >= 32") == _refused("NarrowHead")


def test_a_block_size_under_the_probes_rows_names_the_longest_row_and_the_limit() -> None:
    """nanoGPT's assertion at block_size 4: its own message, its limit, the battery's 127 positions, the fix."""
    assert ("model='user_recipes.nanogpt:short_block': AssertionError: Cannot forward sequence of length 8, block size "
            "is only 4; the model runs rows of at most 4 positions and the battery's rows reach 127 positions under "
            "--batch-format harness (sequences of 128 tokens); build it with block_size (max_position_embeddings) >= "
            "127") == _refused("short_block")


def test_a_position_table_raising_the_vocabularys_index_error_is_read_as_the_row_length() -> None:
    """The position table's IndexError has the embedding's text a small vocabulary has: the probe reruns the model
    on ids of 1 and shorter rows, and names the block size."""
    assert ("model='user_recipes.nanogpt:short_position_table': IndexError: index out of range in self; the model runs "
            "rows of at most 4 positions and the battery's rows reach 127 positions under --batch-format harness "
            "(sequences of 128 tokens); build it with block_size (max_position_embeddings) >= 127"
            ) == _refused("short_position_table")


@pytest.mark.parametrize("batch_format", ["hf", "packed"])
def test_under_the_hf_formats_the_block_size_is_counted_in_tokens(batch_format: str) -> None:
    """hf rows hold T + 1 tokens: a block of 4 fails at 9, and the fix asks for 128."""
    got = _refused("short_block_hf", batch_format)
    assert "sequence of length 9, block size is only 4; the model runs rows of at most 4 positions" in got
    assert got.endswith(f"under --batch-format {batch_format}" + (" (packed rows up to 256 wide, position_ids up to "
                        "127)" if batch_format == "packed" else "") + "; build it with block_size "
                        "(max_position_embeddings) >= 128")


def test_a_block_size_over_the_probes_rows_is_a_note_with_the_limit_and_the_fix() -> None:
    """block_size 64: rows up to 64 positions run (longer cases n/a), and the note says how to check them all."""
    found = facts.probe("user_recipes.nanogpt:half_block")
    assert 64 == found.max_len
    (note,) = found.notes()
    assert note.endswith("a fixed case holding one is n/a; the model runs rows of at most 64 positions and the "
                         "battery's rows reach 127 positions under --batch-format harness (sequences of 128 tokens); "
                         "build it with block_size (max_position_embeddings) >= 127 to check every case")


@pytest.mark.parametrize(("name", "batch_format", "keyword"), [
    ("nanogpt_all_positions", "harness", "targets"), ("hf_style_ignores_minus_one", "hf", "labels")])
def test_a_loss_inside_the_model_that_ignores_minus_one_is_named_with_the_mapping(name: str, batch_format: str,
                                                                                   keyword: str) -> None:
    """Called with the battery's labels, the model's own loss raises "Target -100 is out of bounds": the note says to
    map the ignore index to harness.IGNORE_INDEX."""
    found = facts.probe(f"user_recipes.nanogpt:{name}", batch_format)
    assert (f"model='user_recipes.nanogpt:{name}': its forward's own loss stops on the battery's labels (IndexError: "
            f"Target -100 is out of bounds.): it ignores another index than {IGNORE_INDEX}, which the battery puts at "
            "every unsupervised position; map the ignore index (ignore_index=-100, harness.IGNORE_INDEX) in the "
            f"model's loss, or compute the loss in the recipe (a recipe that calls model(..., {keyword}=...) stops on "
            "every rank)",) == found.notes()


def test_an_unrelated_index_error_is_named_as_seen_not_as_a_vocabulary() -> None:
    """A forward that indexes past its own list fails on ids of 1 and one-position rows too: the raw error, no
    vocabulary or block-size fix."""
    got = _refused("RaisesAnIndexError")
    assert ("model='user_recipes.nanogpt:RaisesAnIndexError': model(inputs) on one battery microbatch (2 rows x 8 "
            "positions, batch format 'harness') failed with IndexError: list index out of range; it fails on ids of 1 "
            "and on rows of one position too, so it is neither the vocabulary (32) nor the row length") in got
    assert "vocab_size >=" not in got and "block_size" not in got


def test_the_refusal_is_bad_input_naming_the_option() -> None:
    """The command line's path: BadInput (exit 2) starting with --model and the model's reading."""
    with pytest.raises(BadInput, match=r"^--model: model='user_recipes.nanogpt:nanogpt': returns logits for 1 of 8"):
        model_notes("user_recipes.nanogpt:nanogpt")


@pytest.mark.parametrize(("path", "batch_format"), [
    (None, "harness"), (None, "hf"), ("user_recipes.nanogpt:nanogpt_fixed", "harness"),
    ("user_recipes.nanogpt:hf_style_fixed", "hf"), ("user_recipes.backward_models:NormWithUnusedHead", "harness")])
def test_a_model_the_battery_can_feed_gets_none_of_these_readings(path: str | None, batch_format: str) -> None:
    """Negative controls: the built-in model, nanoGPT fixed (every position, -100 ignored), its hf-style twin, and a
    model with a LayerNorm and an unused head are probed without a refusal and without any of these notes."""
    found = facts.probe(path, batch_format)
    assert found.max_len is None and found.label_loss is None
    assert not [n for n in found.notes() if any(r in n for r in READINGS)]
