"""A window re-split by a token budget (harness.recipes.dynamic.split_by_tokens, verl's use_dynamic_bsz): rows kept
whole, first fit, every micro-batch within the budget, every row's tokens and labels kept; the token_budget
scenario gives ranks different micro-batch counts at the recipes' budget."""

from __future__ import annotations

import pytest
import torch

from harness.battery import scenarios
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.recipes.dynamic import TOKEN_BUDGET, row_length, split_by_tokens


def _rows(lengths: list[int], prompt: int = 0) -> Microbatch:
    """One microbatch of rows of ``lengths`` real positions, right-padded, each supervised after ``prompt``."""
    width = max(lengths)
    inputs = torch.full((len(lengths), width), PAD, dtype=torch.int64)
    labels = torch.full_like(inputs, IGNORE_INDEX)
    for b, n in enumerate(lengths):
        inputs[b, :n] = torch.arange(1, n + 1) + 100 * b
        labels[b, prompt:n] = torch.arange(2, n + 2 - prompt) + 100 * b
    return Microbatch(inputs, labels)


def _trimmed(mbs: list[Microbatch]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    out = []
    for mb in mbs:
        for i in range(mb.inputs.shape[0]):
            n = row_length(mb, i)
            out.append((tuple(mb.inputs[i, :n].tolist()), tuple(mb.labels[i, :n].tolist())))
    return sorted(out)


def test_rows_go_whole_to_the_first_micro_batch_they_fit_in() -> None:
    """First fit in window order: 60 and 50 open two micro-batches at a budget of 100, 40 joins the first, 30 the
    second, 20 neither (100 and 80 held) and opens a third; each micro-batch is padded to its own longest row."""
    parts = split_by_tokens([_rows([60, 50]), _rows([40, 30, 25])], 100)
    assert [[60, 40], [50, 30], [25]] == [[row_length(mb, i) for i in range(mb.inputs.shape[0])] for mb in parts]
    assert [60, 50, 25] == [mb.inputs.shape[1] for mb in parts]


def test_the_re_split_keeps_every_row_s_tokens_and_labels() -> None:
    """The rows of every micro-batch, trimmed of their padding, are the window's rows: the same inputs, the same
    supervised targets (prompts kept unsupervised), none lost or repeated; the supervised count is the window's."""
    window = [_rows([9, 3, 7], prompt=2), _rows([5, 8])]
    parts = split_by_tokens(window, 12)
    assert _trimmed(window) == _trimmed(parts)
    assert sum(mb.supervised for mb in window) == sum(mb.supervised for mb in parts)
    assert all(sum(row_length(mb, i) for i in range(mb.inputs.shape[0])) <= 12 for mb in parts)


@pytest.mark.parametrize("k", (2, 3, 4, 5))
def test_at_least_splits_the_largest_micro_batch_until_the_count_is_reached(k: int) -> None:
    """FSDP2's equal count: a window that fits one micro-batch is split into exactly as many as asked (every rank
    then runs as many forwards, each an all-gather), rows kept whole."""
    window = [_rows([30, 10, 12, 40]), _rows([5])]
    assert 1 == len(split_by_tokens(window, 100))
    parts = split_by_tokens(window, 100, at_least=k)
    assert k == len(parts) and _trimmed(window) == _trimmed(parts)


def test_at_least_beyond_the_rows_is_refused() -> None:
    """A micro-batch holds one row at least: asking more micro-batches than rows names both numbers."""
    with pytest.raises(ValueError, match=r"at_least=3\): the window holds 2 rows"):
        split_by_tokens([_rows([4, 5])], 100, at_least=3)


def test_a_row_longer_than_the_budget_is_refused_naming_the_budget_and_the_row() -> None:
    """A row is never cut: the message names the budget, the row's length and the setting to raise."""
    with pytest.raises(ValueError, match=r"budget=8\).*holds 9 tokens.*ppo_max_token_len_per_gpu.*9 at least"):
        split_by_tokens([_rows([9, 3])], 8)


@pytest.mark.parametrize("bad", [0, -5, True, 2.5])
def test_a_budget_that_is_not_a_positive_count_is_refused(bad: object) -> None:
    """The budget is a positive int of tokens; the message names the value."""
    with pytest.raises(ValueError, match=rf"budget={bad!r}"):
        split_by_tokens([_rows([3])], bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("world", (2, 3, 4, 8), ids=lambda w: f"world{w}")
def test_the_token_budget_scenario_gives_ranks_different_micro_batch_counts(world: int) -> None:
    """At the recipes' budget (twice the longest sequence) the ranks of token_budget run different numbers of
    micro-batches, and rank 0 holds one of the longest rows among its short ones."""
    window = scenarios.build("token_budget", world)[0]
    counts = [len(split_by_tokens(rank, TOKEN_BUDGET)) for rank in window]
    assert len(set(counts)) > 1, counts
    longest = max(row_length(mb, i) for rank in window for mb in rank for i in range(mb.inputs.shape[0]))
    assert longest - 8 <= max(row_length(window[0][0], i) for i in range(window[0][0].inputs.shape[0]))
