"""Packed runs' readings and the sequence mean on packed rows: the boundary pairs the diagnosis fits beside the
blocks are the pairs labels rebuilt across a packed row add, the arithmetic of a mean over packs (and the weights it
must not name), and the sequence mean counting sequences, never rows."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from harness.core.formats import packed_layout, to_hf, to_packed
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.diagnosis.fit import Block
from harness.diagnosis.packed import CountFacts, boundary_pairs, boundary_sentence, count_facts, named_count
from harness.diagnosis.prompts import prompt_labels
from harness.diagnosis.row_weights import pack_mean_weights, read_packs
from harness.recipes.controls.packed import PackedSequenceMeanOverRows, _across_boundaries
from harness.recipes.objectives import SequenceMean, forward, sequence_ids, supervised_sequences

I = IGNORE_INDEX  # noqa: E741


def _microbatch() -> Microbatch:
    """Five rows of 3, 4, 2, 5 and 3 real tokens (the third with a one-token prompt), packed into two rows of at most
    10 tokens: [0, 1, 2] and [3, 4]."""
    inputs = torch.tensor([[1, 2, PAD, PAD], [4, 5, 6, PAD], [7, PAD, PAD, PAD], [9, 10, 11, 12], [13, 14, PAD, PAD]])
    labels = torch.tensor([[2, 3, I, I], [5, 6, 7, I], [I, I, I, I], [10, 11, 12, 8], [14, 15, I, I]])
    labels[2, 0] = 8  # row 2: token 7, target 8 (its hf form has 2 real tokens)
    return Microbatch(inputs, labels)


def test_the_packed_layout_is_the_order_to_packed_writes_the_sequences_in() -> None:
    """Each packed row's input_ids are the hf rows packed_layout names, in order, then padding."""
    mb = _microbatch()
    hf, packed = to_hf(mb), to_packed(mb)
    layout = packed_layout(mb)
    assert [[0, 1, 2], [3, 4]] == layout
    for r, pack in enumerate(layout):
        tokens = [t for b in pack for t in hf["input_ids"][b][hf["attention_mask"][b].bool()].tolist()]
        assert tokens == packed["input_ids"][r, :len(tokens)].tolist()
        assert all(t == PAD for t in packed["input_ids"][r, len(tokens):].tolist())


def test_the_boundary_pairs_are_exactly_the_pairs_labels_rebuilt_across_the_row_add() -> None:
    """The pairs the diagnosis fits (a sequence's last token, the next sequence's first token) are the (context
    token, target) pairs the separator-less labels hold and the batch's do not; padding adds none."""
    mb = _microbatch()
    packed = to_packed(mb)
    rebuilt = _across_boundaries(packed)
    added = (rebuilt[:, 1:] != packed["labels"][:, 1:]).nonzero().tolist()
    got = sorted((int(packed["input_ids"][r, t]), int(rebuilt[r, t + 1])) for r, t in added)
    ids = to_hf(mb)["input_ids"]
    want = sorted((int(ids[b, at]), token) for b, at, token in boundary_pairs(mb))
    assert 3 == len(want)  # two boundaries in the first packed row, one in the second
    assert want == got


def test_the_count_facts_are_the_counts_the_rebuilt_labels_and_the_rows_positions_give() -> None:
    """N + B is the count of the labels rebuilt over the whole row (the controls' count), N + P + B the packed rows'
    positions after the shift that are not padding; B is the boundary pairs, P the prompt positions."""
    plain = _microbatch()
    labels = plain.labels.clone()
    labels[3, 0] = I  # row 3 gets a one-token prompt
    mb = Microbatch(plain.inputs, labels)
    packed = to_packed(mb)
    facts = count_facts([mb])
    assert (mb.supervised, 3) == (facts.n, facts.boundaries)
    assert int((_across_boundaries(packed)[:, 1:] != IGNORE_INDEX).sum()) == facts.n + facts.boundaries
    assert int((packed["input_ids"][:, 1:] != PAD).sum()) == facts.positions
    assert int((prompt_labels(mb) != IGNORE_INDEX).sum()) == facts.prompts == 1
    assert ["N + B", "N + P + B"] == [formula for _, formula, _ in facts.counts()]


def test_a_common_scale_is_named_as_a_boundary_count_only_where_one_token_would_show() -> None:
    """c = N / (N + B) is named; the same c read at a tolerance wider than one token of the count is not, nor a
    window without a boundary."""
    facts = CountFacts(n=100, boundaries=4, positions=110)
    assert named_count(facts, 100 / 104, 1e-6) is not None
    assert named_count(facts, 100 / 104, 1e-2) is None
    assert named_count(CountFacts(n=100, boundaries=0, positions=100), 1.0, 1e-6) is None


def test_a_microbatch_of_one_sequence_has_no_boundary_pair() -> None:
    """One sequence is one packed row: nothing crosses a boundary."""
    assert [] == boundary_pairs(Microbatch(torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 4]])))


def test_boundary_columns_at_the_weight_of_a_supervised_token_are_named() -> None:
    """Ratios of one value read as the boundary pairs' term; 1 reads "like every supervised token"."""
    words = boundary_sentence([1.0, 1.0, math.nan], pairs=5, n=100)
    assert words is not None and "5 pairs" in words and "like every supervised token" in words


def test_boundary_columns_of_different_weights_are_not_named() -> None:
    """Boundary pairs weighing differently per microbatch are no term of the loss that rebuilt labels add."""
    assert boundary_sentence([1.0, 2.0], pairs=5, n=100) is None


def _rows(tokens: list[int]) -> list[Block]:
    return [Block(0, 0, n, row=i) for i, n in enumerate(tokens)]


ROWS = _rows([3, 5, 2, 7, 4])
PACKS = [0, 0, 1, 1, 2]


def test_pack_mean_weights_are_one_over_the_packs_count_times_the_pack_count() -> None:
    """Packs of 8, 9 and 4 supervised tokens, P=3: a token of pack 0 weighs 1/(8*3)."""
    assert pytest.approx([1 / 24, 1 / 24, 1 / 27, 1 / 27, 1 / 12]) == pack_mean_weights(ROWS, PACKS)


def test_a_mean_over_packs_reads_per_pack_mean_with_its_scale() -> None:
    """Token weights of a mean over packs, times 0.5, read per_pack_mean with factor 0.5."""
    weights = [0.5 * w for w in pack_mean_weights(ROWS, PACKS)]
    sig = read_packs(ROWS, weights, PACKS, 1e-7, "the declared")
    assert sig is not None and "per_pack_mean" == sig.name
    assert sig.factor == pytest.approx(0.5)
    assert "P=3" in sig.sentence


@pytest.mark.parametrize("kind", ["sequence_mean", "token_mean"])
def test_a_sequence_mean_or_a_token_mean_is_not_read_as_a_mean_over_packs(kind: str) -> None:
    """The sequence mean (1/(n_s S)) and the token mean (1/N) of the same rows are no mean over packs."""
    n = sum(b.tokens for b in ROWS)
    weights = [1 / (b.tokens * len(ROWS)) if kind == "sequence_mean" else 1 / n for b in ROWS]
    assert read_packs(ROWS, weights, PACKS, 1e-7, "the declared") is None


def test_packs_of_one_sequence_each_are_not_read_as_a_mean_over_packs() -> None:
    """Where every pack holds one sequence, a mean over packs is the sequence mean itself: nothing to name."""
    weights = [1 / (b.tokens * len(ROWS)) for b in ROWS]
    assert read_packs(ROWS, weights, list(range(len(ROWS))), 1e-7, "the declared") is None


class _TokenModel(nn.Module):
    """Logits from each position's own token: the per-token losses are the same packed or not."""

    def __init__(self) -> None:
        super().__init__()
        # Fixed weights from a generator of its own: the global one is left alone.
        self.emb = nn.Embedding.from_pretrained(torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.emb(input_ids)


def _sequence_term(recipe: SequenceMean, batch: object) -> float:
    with torch.no_grad():
        _, ce, mask, _ = forward(_TokenModel(), batch)
        return float(recipe.term_of(batch, ce, mask, None))


def test_the_sequence_mean_counts_a_packed_batchs_sequences_never_its_rows() -> None:
    """Five sequences in two packed rows: S=5, as in the hf batch; the rows' count (2) is the control's."""
    mb = _microbatch()
    packed = to_packed(mb)
    assert 2 == packed["input_ids"].shape[0]
    assert 5 == supervised_sequences(packed) == supervised_sequences(to_hf(mb)) == supervised_sequences(mb)


def test_the_sequence_mean_term_of_packed_rows_is_the_unpacked_sequences_one() -> None:
    """The sum of the sequences' means over the packed rows equals it over the hf rows, by seq_idx or by the
    position_ids' restarts alike; the per-row mean of the control does not."""
    mb = _microbatch()
    packed = to_packed(mb)
    want = _sequence_term(SequenceMean(), to_hf(mb))
    assert want == pytest.approx(_sequence_term(SequenceMean(), packed), rel=1e-6)
    no_idx = {k: v for k, v in packed.items() if k != "seq_idx"}
    by_idx, by_restarts = sequence_ids(packed), sequence_ids(no_idx)
    assert by_idx is not None and by_restarts is not None
    assert torch.equal(by_idx, by_restarts)
    assert want == pytest.approx(_sequence_term(SequenceMean(), no_idx), rel=1e-6)
    assert _sequence_term(PackedSequenceMeanOverRows(), packed) != pytest.approx(want, rel=1e-3)


def test_the_rows_of_an_unpacked_batch_are_its_sequences() -> None:
    """No sequence ids for a harness or hf batch: each row is one sequence."""
    mb = _microbatch()
    assert sequence_ids(mb) is None and sequence_ids(to_hf(mb)) is None
