"""collate and Microbatch: padded inputs, aligned labels, IGNORE_INDEX wherever a position is not supervised."""

from __future__ import annotations

import re

import pytest
import torch

from harness import IGNORE_INDEX, PAD, Microbatch
from harness.data.batching import collate
from harness.data.corpus import Row

ROWS = (
    Row(id=0, split="train", tokens=(3, 4, 5, 6, 7, 1, 2, 3), prompt_len=3),
    Row(id=1, split="train", tokens=(2, 4, 6), prompt_len=0),
    Row(id=2, split="train", tokens=(5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1), prompt_len=2),
    Row(id=3, split="train", tokens=(1, 2, 3, 4, 5), prompt_len=1),
)


@pytest.fixture
def mb() -> Microbatch:
    return collate(ROWS)


def _ints(*shape: int) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.int64)


# --- collate ---------------------------------------------------------------------------------------------------------


def test_collate_shape_is_rows_by_longest_length_minus_one(mb: Microbatch) -> None:
    """B is the number of rows and T the longest row's length minus one (the last token is only a target)."""
    assert ((4, 10), (4, 10)) == (tuple(mb.inputs.shape), tuple(mb.labels.shape))


def test_collate_gives_int64_tensors(mb: Microbatch) -> None:
    """Inputs and labels are int64, as cross-entropy and the embedding expect."""
    assert (torch.int64, torch.int64) == (mb.inputs.dtype, mb.labels.dtype)


@pytest.mark.parametrize("b", range(len(ROWS)), ids=lambda b: f"row{b}")
def test_inputs_are_the_row_without_its_last_token_then_pad(mb: Microbatch, b: int) -> None:
    """inputs[b] is tokens[:-1] followed by PAD up to the batch width."""
    tokens = ROWS[b].tokens
    expected = [*tokens[:-1], *[PAD] * (mb.inputs.shape[1] - len(tokens) + 1)]
    assert expected == mb.inputs[b].tolist()


@pytest.mark.parametrize("b", range(len(ROWS)), ids=lambda b: f"row{b}")
def test_labels_are_the_next_token_where_supervised(mb: Microbatch, b: int) -> None:
    """labels[b, t] == tokens[t + 1] for t from max(prompt_len - 1, 0) to the row's end, IGNORE_INDEX elsewhere."""
    row = ROWS[b]
    first, end = max(row.prompt_len - 1, 0), len(row.tokens) - 1
    width = mb.labels.shape[1]
    expected = [row.tokens[t + 1] if first <= t < end else IGNORE_INDEX for t in range(width)]
    assert expected == mb.labels[b].tolist()


def test_padding_positions_carry_ignore_index(mb: Microbatch) -> None:
    """Every position whose input is PAD (after a row's end) has label IGNORE_INDEX."""
    assert torch.all(mb.labels[mb.inputs == PAD] == IGNORE_INDEX)
    assert int((mb.inputs == PAD).sum()) > 0


def test_prompt_targets_carry_ignore_index(mb: Microbatch) -> None:
    """Row 0 has a 3-token prompt: targets tokens[1] and tokens[2] (positions 0 and 1) are not supervised."""
    assert [IGNORE_INDEX, IGNORE_INDEX, 6] == mb.labels[0, :3].tolist()


def test_supervised_is_the_sum_of_the_rows(mb: Microbatch) -> None:
    """Microbatch.supervised counts only the rows' supervised targets: 5 + 2 + 9 + 4."""
    assert (20, 20) == (sum(r.supervised for r in ROWS), mb.supervised)


def test_collate_of_one_row_has_no_padding() -> None:
    """A single row fills its microbatch: no PAD, no IGNORE_INDEX beyond the prompt."""
    row = ROWS[3]
    mb = collate([row])
    assert ([1, 2, 3, 4], [2, 3, 4, 5]) == (mb.inputs[0].tolist(), mb.labels[0].tolist())


def test_collate_rejects_no_rows() -> None:
    """collate([]) is a ValueError: a microbatch has at least one row."""
    with pytest.raises(ValueError, match="at least one Row"):
        collate([])


def test_to_keeps_inputs_and_labels(mb: Microbatch) -> None:
    """Microbatch.to returns a microbatch with the same values on the target device."""
    moved = mb.to("cpu")
    assert torch.equal(mb.inputs, moved.inputs)
    assert torch.equal(mb.labels, moved.labels)


# --- Microbatch validation -------------------------------------------------------------------------------------------

BAD_TENSORS = {
    "int32": torch.ones(2, 3, dtype=torch.int32),
    "float": torch.ones(2, 3),
    "1d": torch.ones(3, dtype=torch.int64),
    "3d": torch.ones(2, 3, 1, dtype=torch.int64),
    "list": [[1, 2, 3], [4, 5, 6]],
}


@pytest.mark.parametrize("bad", list(BAD_TENSORS.values()), ids=list(BAD_TENSORS))
def test_microbatch_rejects_bad_inputs_naming_inputs(bad: object) -> None:
    """inputs that are not an int64 [B, T] tensor raise TypeError naming Microbatch.inputs."""
    with pytest.raises(TypeError, match=r"Microbatch\.inputs"):
        Microbatch(bad, _ints(2, 3))  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", list(BAD_TENSORS.values()), ids=list(BAD_TENSORS))
def test_microbatch_rejects_bad_labels_naming_labels(bad: object) -> None:
    """labels that are not an int64 [B, T] tensor raise TypeError naming Microbatch.labels."""
    with pytest.raises(TypeError, match=r"Microbatch\.labels"):
        Microbatch(_ints(2, 3), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("inputs_shape", "labels_shape"), [((2, 3), (2, 4)), ((2, 3), (3, 3))], ids=["width", "batch"])
def test_microbatch_rejects_mismatched_shapes(inputs_shape: tuple[int, int], labels_shape: tuple[int, int]) -> None:
    """inputs and labels of different shapes raise ValueError showing both shapes."""
    pattern = rf"inputs {re.escape(str(inputs_shape))}.*labels {re.escape(str(labels_shape))}"
    with pytest.raises(ValueError, match=pattern):
        Microbatch(_ints(*inputs_shape), _ints(*labels_shape))


def test_microbatch_rejects_an_empty_batch() -> None:
    """B = 0 raises ValueError: a microbatch holds at least one row."""
    with pytest.raises(ValueError, match="B >= 1"):
        Microbatch(_ints(0, 3), _ints(0, 3))


def test_microbatch_accepts_all_ignored_labels() -> None:
    """A microbatch with no supervised token is valid and counts 0."""
    mb = Microbatch(_ints(2, 3), torch.full((2, 3), IGNORE_INDEX, dtype=torch.int64))
    assert 0 == mb.supervised
