"""The per-row readings under context parallelism (``harness.diagnosis.row_weights.merge_chunks``): a row's cp chunks
weighed alike are one whole row of its data rank, and chunks weighed apart are left to the reading by token rank."""

from __future__ import annotations

from harness.diagnosis.fit import Block
from harness.diagnosis.row_weights import merge_chunks, read_rows

# dp=2, cp=2: token rank t = data rank x 2 + cp rank; each row's chunk counts (cp 0, cp 1), whole counts their sums.
CHUNKS = {(0, 0, 0): (12, 20), (0, 0, 1): (7, 0), (0, 1, 0): (30, 9), (1, 0, 0): (50, 11), (1, 0, 1): (22, 5),
          (1, 1, 0): (4, 40), (1, 1, 1): (16, 16)}
"""(data rank, microbatch, row): its tokens in each cp rank's chunk."""

ROWS = [Block(d * 2 + c, m, n[c], row=r) for (d, m, r), n in CHUNKS.items() for c in range(2)]
WHOLE = [sum(CHUNKS[(b.rank // 2, b.microbatch, b.row or 0)]) for b in ROWS]


def _sequences(d: int) -> int:
    return sum(1 for key in CHUNKS if key[0] == d)


def test_a_sequence_count_local_to_a_data_rank_reads_a_mean_of_local_means_over_whole_rows() -> None:
    """Every token of a row weighs 1/(dp * its data rank's sequences * the row's whole count): its chunks merge into
    the row, and the merged rows read ``mean_of_local_means`` at dp's size."""
    weights = [1 / (2 * _sequences(b.rank // 2) * n) if b.tokens else float("nan") for b, n in zip(ROWS, WHOLE)]
    merged = merge_chunks(ROWS, weights, WHOLE, 2)
    assert merged is not None
    rows, _ = merged
    assert len(CHUNKS) == len(rows)
    assert {0, 1} == {b.rank for b in rows}
    sig = read_rows(*merged, 2, 2, 1e-7, "")
    assert sig is not None and "mean_of_local_means" == sig.name, sig
    assert "times" not in sig.sentence


def test_chunks_divided_by_their_own_counts_are_not_merged() -> None:
    """A mean per chunk weighs a row's chunks apart (1/n_chunk each): no whole row to read, and the rows by token
    rank read the count local to each cp rank's chunk as ``mean_of_local_means`` over the token group."""
    live = [b for b in ROWS if b.tokens]
    per_rank = {t: sum(1 for b in live if b.rank == t) for t in range(4)}
    weights = [1 / (4 * per_rank[b.rank] * b.tokens) if b.tokens else float("nan") for b in ROWS]
    assert merge_chunks(ROWS, weights, WHOLE, 2) is None
    sig = read_rows(ROWS, weights, 4, 2, 1e-7, "")
    assert sig is not None and "mean_of_local_means" == sig.name, sig
