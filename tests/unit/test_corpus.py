"""Corpus: deterministic rows, split sizes, lengths and prompts, and a data lock that follows the data."""

from __future__ import annotations

import pytest

from harness.data.config import Config
from harness.data.corpus import SPLITS, Row, data_lock, make_corpus, split_rows

# Small enough to build in a few milliseconds, for the tests that build several corpora.
SMALL = Config(train_size=64, val_size=8, test_size=8)


# --- determinism and the data lock -----------------------------------------------------------------------------------


def test_same_config_gives_the_same_rows(config: Config, rows: list[Row]) -> None:
    """Building the corpus twice from one config gives identical rows."""
    assert rows == make_corpus(config)


def test_same_config_gives_the_same_data_lock(config: Config, rows: list[Row]) -> None:
    """The data lock of a rebuilt corpus is the same 64-hex-digit SHA-256."""
    lock = data_lock(rows, config)
    assert (64, lock) == (len(lock), data_lock(make_corpus(config), config))


def test_other_seed_gives_other_rows_and_other_lock() -> None:
    """Changing the seed changes the rows and the lock."""
    other = SMALL.replace(seed=SMALL.seed + 1)
    rows, other_rows = make_corpus(SMALL), make_corpus(other)
    assert rows != other_rows
    assert data_lock(rows, SMALL) != data_lock(other_rows, other)


@pytest.mark.parametrize(
    "changes",
    [{"lr": 0.1}, {"world_size": 3}, {"momentum": 0.5}, {"d_model": 16}, {"dropout": 0.0}, {"precision": "fp64"}],
    ids=["lr", "world_size", "momentum", "d_model", "dropout", "precision"],
)
def test_a_non_data_field_does_not_change_the_lock(changes: dict[str, object]) -> None:
    """Fields that do not shape the data (optimizer, model, ranks) leave rows and lock unchanged."""
    other = SMALL.replace(**changes)
    other_rows = make_corpus(other)
    assert (make_corpus(SMALL), data_lock(make_corpus(SMALL), SMALL)) == (other_rows, data_lock(other_rows, other))


@pytest.mark.parametrize(
    "changes",
    [{"noise": 0.2}, {"prompt_fraction": 0.5}, {"prompt_max": 4}, {"vocab_size": 16}, {"max_len": 64}, {"seed": 7}],
    ids=["noise", "prompt_fraction", "prompt_max", "vocab_size", "max_len", "seed"],
)
def test_a_data_field_changes_the_lock(changes: dict[str, object]) -> None:
    """Every field that shapes the data changes the lock."""
    other = SMALL.replace(**changes)
    assert data_lock(make_corpus(SMALL), SMALL) != data_lock(make_corpus(other), other)


def test_the_lock_covers_the_data_field_even_when_rows_match() -> None:
    """With noise already 0, a different noise in the config alone changes the lock (the fields are hashed too)."""
    quiet = SMALL.replace(noise=0.0, prompt_fraction=0.0)
    rows = make_corpus(quiet)
    assert data_lock(rows, quiet) != data_lock(rows, quiet.replace(noise=0.5))


def test_one_changed_token_changes_the_lock() -> None:
    """The lock covers every token: altering one token of one row changes it."""
    rows = make_corpus(SMALL)
    first = rows[0]
    changed = Row(
        id=first.id, split=first.split, tokens=(first.tokens[0] % 5 + 1, *first.tokens[1:]), prompt_len=first.prompt_len
    )
    assert changed != first
    assert data_lock(rows, SMALL) != data_lock([changed, *rows[1:]], SMALL)


def test_make_corpus_rejects_a_non_config() -> None:
    """Passing a dict instead of a Config is a TypeError that names the type."""
    with pytest.raises(TypeError, match="dict"):
        make_corpus({"seed": 1})  # type: ignore[arg-type]


# --- sizes, ids, lengths, tokens -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("split", "expected"), [("train", 1024), ("val", 128), ("test", 256)], ids=SPLITS)
def test_split_sizes_follow_the_config(rows: list[Row], split: str, expected: int) -> None:
    """The minimum config gives 1024 train, 128 validation and 256 test rows."""
    assert expected == len(split_rows(rows, split))


def test_ids_are_consecutive_in_split_order(rows: list[Row]) -> None:
    """Ids run 0 .. N-1 and the splits come in the order train, val, test."""
    assert (list(range(1408)), ["train"] * 1024 + ["val"] * 128 + ["test"] * 256) == (
        [r.id for r in rows],
        [r.split for r in rows],
    )


def test_split_rows_rejects_an_unknown_split(rows: list[Row]) -> None:
    """An unknown split name is a ValueError that names it."""
    with pytest.raises(ValueError, match="split='validation'"):
        split_rows(rows, "validation")


def test_lengths_lie_within_min_len_and_max_len(config: Config, rows: list[Row]) -> None:
    """Every row has between min_len (16) and max_len (128) tokens, and both ends occur."""
    lengths = [len(r.tokens) for r in rows]
    assert (config.min_len, config.max_len) == (min(lengths), max(lengths))


def test_tokens_are_never_pad_and_stay_in_the_vocabulary(config: Config, rows: list[Row]) -> None:
    """Token ids lie in 1 .. vocab_size - 1; id 0 is reserved for padding."""
    ids = {t for r in rows for t in r.tokens}
    assert (1, config.vocab_size - 1) == (min(ids), max(ids))


# --- prompts and supervised counts -----------------------------------------------------------------------------------


def test_some_rows_have_a_prompt_and_most_do_not(config: Config, rows: list[Row]) -> None:
    """About prompt_fraction (0.3) of the rows start with a prompt; the others have prompt_len 0."""
    share = sum(r.prompt_len > 0 for r in rows) / len(rows)
    assert 0.2 < share < 0.4


def test_prompt_lengths_lie_between_two_and_prompt_max(config: Config, rows: list[Row]) -> None:
    """A prompt is 0 (none) or 2 .. prompt_max tokens long, and every value in that range occurs."""
    assert {0, *range(2, config.prompt_max + 1)} == {r.prompt_len for r in rows}


def test_row_supervised_is_length_minus_prompt_or_one(rows: list[Row]) -> None:
    """Row.supervised is len(tokens) - max(prompt_len, 1) for every row of the corpus."""
    assert [len(r.tokens) - max(r.prompt_len, 1) for r in rows] == [r.supervised for r in rows]


@pytest.mark.parametrize(
    ("length", "prompt_len", "expected"),
    [(10, 0, 9), (10, 1, 9), (10, 2, 8), (10, 4, 6), (3, 2, 1)],
    ids=["no-prompt", "prompt1", "prompt2", "prompt4", "shortest"],
)
def test_row_supervised_on_hand_made_rows(length: int, prompt_len: int, expected: int) -> None:
    """The first token is never a target, and neither is any token inside the prompt."""
    row = Row(id=0, split="train", tokens=tuple(range(1, length + 1)), prompt_len=prompt_len)
    assert expected == row.supervised


def test_every_row_has_a_supervised_token(rows: list[Row]) -> None:
    """prompt_max <= min_len - 1 guarantees at least one supervised target per row."""
    assert 1 <= min(r.supervised for r in rows)


def test_supervised_count_differs_from_length_on_prompted_rows(rows: list[Row]) -> None:
    """On prompted rows the supervised count is below length - 1: length is not the denominator."""
    prompted = [r for r in rows if r.prompt_len >= 2]
    assert all(r.supervised < len(r.tokens) - 1 for r in prompted)
    assert prompted
