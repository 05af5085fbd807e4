"""The diagnosis read from evidence built by hand, with no launch and no battery type: each family's reading comes out
of :func:`harness.diagnosis.diagnose.diagnose` from a gradient made of the blocks' own gradients with the weights a
known mistake gives, and the right weighting of the same evidence reads ``correct`` (the negative control)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.evidence import TinyConvention, block_gradients, hand_evidence, microbatch

from harness.core.formats import PACKED, logits_of, packed_layout, shifted_loss_sum, to_hf
from harness.core.mesh import Mesh
from harness.core.microbatch import Microbatch
from harness.core.objectives import Objective
from harness.diagnosis.count_groups import counts_over
from harness.diagnosis.diagnose import diagnose
from harness.diagnosis.evidence import Evidence, RankWindow
from harness.diagnosis.mesh import token_blocks
from harness.diagnosis.packed import boundary_columns, count_facts
from harness.diagnosis.prompts import prompt_columns
from harness.distributed.pipeline import ScheduleStep


def reading(ev: Evidence, **kw: object) -> str:
    found = diagnose(ev, 0, 0, **kw)  # type: ignore[arg-type]
    assert found is not None
    assert found.fix, found.signature  # every reading carries its fix
    return found.signature.name


# Two data ranks with different token counts: the case where a mean of means goes wrong.
UNEVEN = [[microbatch([5, 3], seed=1), microbatch([4], seed=2)],
          [microbatch([12, 9], seed=3), microbatch([11, 10], seed=4)]]


def test_the_right_weighting_reads_correct_and_a_mean_of_local_means_is_named() -> None:
    """The plain token mean's family (the catalog): every block at 1/N is correct; each rank's blocks at
    1/(W * N_rank) are the mean of local means."""
    assert "correct" == reading(hand_evidence(UNEVEN))
    own = [sum(mb.supervised for mb in rank) for rank in UNEVEN]
    weights = [1 / (2 * own[r]) for r, rank in enumerate(UNEVEN) for _ in rank]
    assert "mean_of_local_means" == reading(hand_evidence(UNEVEN, weights))


def test_a_zero_gradient_after_no_synchronization_is_named_by_the_ranks_family() -> None:
    right = hand_evidence(UNEVEN)
    assert right.records is not None
    zero = [[dataclasses.replace(recs[0], grad=torch.zeros_like(recs[0].grad), syncs=0)]  # type: ignore[arg-type]
            for recs in right.records]
    assert "not_synchronized" == reading(dataclasses.replace(right, records=zero))


def test_the_objective_family_names_the_objective_the_gradient_is() -> None:
    """Declared: the sequence mean; given: the token mean's gradient. Its control: the sequence mean's own."""
    declared = Objective("sequence_mean")
    token_mean = hand_evidence(UNEVEN, objective=declared)
    assert "other_objective" == reading(token_mean)
    rows = [mb.row(i) for rank in UNEVEN for mb in rank for i in range(mb.inputs.shape[0])]
    grads = block_gradients(TinyConvention(dtype=torch.float64), token_mean.reference_starts[0], rows)
    seq = sum(g / (row.supervised * len(rows)) for g, row in zip(grads, rows))
    assert isinstance(seq, torch.Tensor)
    right = hand_evidence(UNEVEN, objective=declared, grads=[seq, seq])
    right = dataclasses.replace(right, references=[dataclasses.replace(right.references[0], gradient=seq)])  # type: ignore[type-var]
    assert "correct" == reading(right)


def test_the_clipping_family_names_a_clip_that_never_engaged() -> None:
    """The reference is clipped to half its norm; a gradient left unclipped reads clipping_not_applied, the clipped
    one correct."""
    plain = hand_evidence(UNEVEN)
    ref = plain.references[0]
    assert ref is not None
    norm = float(ref.gradient.norm())
    clipped = dataclasses.replace(ref, gradient=ref.gradient * (norm / 2) / (norm + 1e-6))
    ev = dataclasses.replace(plain, references=[clipped], reference_norms=[norm], max_norm=norm / 2)
    assert "clipping_not_applied" == reading(ev)
    assert ev.records is not None
    done = [[dataclasses.replace(recs[0], grad=clipped.gradient)] for recs in ev.records]
    assert "correct" == reading(dataclasses.replace(ev, records=done))


def test_the_pipeline_family_reads_scale_grads_over_two_steps() -> None:
    """pp=2, one data rank, three microbatches in two schedule steps of M=2 under scale_grads=True: step 0's
    microbatches weigh 1/2 (torchtitan #1733)."""
    window = [[microbatch([5, 3, 4, 2], seed=5), microbatch([6, 2, 3], seed=6), microbatch([7, 4], seed=7)]]
    rows = tuple(mb.inputs.shape[0] for mb in window[0])
    steps = tuple(ScheduleStep(2, True, tuple((i, j) for i in part for j in range(rows[i]))) for part in ([0, 1], [2]))
    n = sum(mb.supervised for mb in window[0])
    base = hand_evidence(window, mesh=Mesh.parse("pp=2"))
    wrong = hand_evidence(window, [0.5 / n, 0.5 / n, 1.0 / n], mesh=Mesh.parse("pp=2"))
    for ev, want in ((wrong, "pp_scale_grads"), (base, "correct")):
        assert ev.records is not None
        recs = [[dataclasses.replace(r[0], pipeline_steps=steps)] for r in ev.records]
        assert want == reading(dataclasses.replace(ev, records=recs))


def test_the_mesh_family_names_the_group_a_count_was_reduced_over() -> None:
    """dp=2,cp=2: each cp rank's chunk divided by the count over dp only (its cp coordinate's tokens) reads
    count_group; the count over the token group, dp x cp, reads correct."""
    mesh = Mesh.parse("dp=2,cp=2")
    base = hand_evidence(UNEVEN, mesh=mesh)
    held = token_blocks(base, 0)
    grads = block_gradients(TinyConvention(dtype=torch.float64), base.reference_starts[0], [mb for _, mb in held])
    per: dict[int, int] = {}
    for b, _ in held:
        per[b.rank] = per.get(b.rank, 0) + b.tokens
    over_dp = counts_over(mesh, per, ("dp",))
    wrong = sum(g / over_dp[b.rank] / mesh.size("cp") for (b, _), g in zip(held, grads) if b.tokens)
    assert isinstance(wrong, torch.Tensor)
    ev = hand_evidence(UNEVEN, mesh=mesh, grads=[wrong] * mesh.world_size)
    assert "count_group" == reading(ev)
    assert "correct" == reading(base)


@dataclasses.dataclass(frozen=True)
class PackedConvention(TinyConvention):
    """The packed batch format: a packed run's reference is its sequences unpacked, one padded row each with its
    attention mask, the labels shifted in the loss."""

    batch_format: str = PACKED

    def loss_sum(self, model: torch.nn.Module, mb: Microbatch) -> torch.Tensor:
        batch = to_hf(mb)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return shifted_loss_sum(logits_of(out), batch["labels"])

    def logits(self, model: torch.nn.Module, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
        batch = to_hf(mb)
        raw = logits_of(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
        return raw, raw[:, :-1]

    def reference_batch(self, mb: Microbatch) -> object:
        return to_hf(mb)


def test_the_packed_family_reads_a_mean_over_packed_rows() -> None:
    """Every token of packed row r weighs 1/(n_r * P): a sequence mean that counted the packed rows as its
    sequences (per_pack_mean); the token mean over the same packed evidence reads correct."""
    window = [[microbatch([5, 3, 4, 2], seed=8, prompt=1)], [microbatch([9, 7, 6], seed=9, prompt=1)]]
    conv = PackedConvention(dtype=torch.float64)
    base = dataclasses.replace(hand_evidence(window), model=conv)
    start = base.reference_starts[0]
    sequences, weights = [], []
    packs = [(r, pack) for r, rank in enumerate(window) for mb in rank for pack in packed_layout(mb)]
    for r, pack in packs:
        rows = [window[r][0].row(i) for i in pack]
        n_r = sum(row.supervised for row in rows)
        sequences += rows
        weights += [1 / (n_r * len(packs))] * len(rows)
    grads = block_gradients(conv, start, sequences)
    wrong = sum(w * g for w, g in zip(weights, grads))
    tokens = sum(row.supervised for row in sequences)
    right = sum(g / tokens for g in grads)
    assert isinstance(wrong, torch.Tensor) and isinstance(right, torch.Tensor)
    reference = dataclasses.replace(base.references[0], gradient=right)  # type: ignore[type-var]
    for grad, want in ((wrong, "per_pack_mean"), (right, "correct")):
        recs = [[RankWindow(grad=grad, params_before=start, syncs=1)] for _ in window]
        ev = dataclasses.replace(base, records=recs, references=[reference])
        assert want == reading(ev)


PACKED_WINDOW = [[microbatch([5, 3, 4, 2], seed=8, prompt=1)], [microbatch([9, 7, 6], seed=9, prompt=1)]]
"""Two ranks of one microbatch each, every row with a one-token prompt: packed into rows that hold boundaries."""


def _packed_reading(column_weights: dict[str, float]) -> tuple[str, str]:
    """``(signature, sentence)`` of a packed run whose gradient is each microbatch's loss sum (``"blocks"``), its
    boundary pairs' loss (``"pairs"``) and its prompt positions' loss (``"prompts"``) at the weights given; the
    reference is the blocks at 1/N."""
    conv = PackedConvention(dtype=torch.float64)
    base = dataclasses.replace(hand_evidence(PACKED_WINDOW), model=conv)
    start = base.reference_starts[0]
    mbs = [mb for rank in PACKED_WINDOW for mb in rank]
    model = base.model_at(start, torch.float64)
    pairs = boundary_columns(base, model, mbs)
    prompts = prompt_columns(base, model, mbs)
    assert pairs is not None and prompts is not None
    columns = {"blocks": torch.stack(block_gradients(conv, start, mbs), dim=1), "pairs": pairs, "prompts": prompts[0]}
    grad = sum(w * columns[name].sum(dim=1) for name, w in column_weights.items())
    right = columns["blocks"].sum(dim=1) / sum(mb.supervised for mb in mbs)
    assert isinstance(grad, torch.Tensor)
    reference = dataclasses.replace(base.references[0], gradient=right)  # type: ignore[type-var]
    recs = [[RankWindow(grad=grad, params_before=start, syncs=1)] for _ in PACKED_WINDOW]
    found = diagnose(dataclasses.replace(base, records=recs, references=[reference]), 0, 0)
    assert found is not None and found.fix, found
    return found.signature.name, found.signature.sentence + " | fix: " + found.fix


def _packed_counts() -> tuple[int, int, int, int]:
    """``(N, P, B, S)`` of :data:`PACKED_WINDOW`: supervised tokens, prompt positions, boundaries inside the packed
    rows, sequences."""
    facts = count_facts([mb for rank in PACKED_WINDOW for mb in rank])
    sequences = sum(mb.inputs.shape[0] for rank in PACKED_WINDOW for mb in rank)
    return facts.n, facts.prompts, facts.boundaries, sequences


@pytest.mark.parametrize("formula", ["N + B", "N + P + B"])
def test_a_count_that_takes_the_packed_boundaries_for_targets_reads_counted_across_boundaries(formula: str) -> None:
    """The batch's loss over N + B (labels rebuilt over the row, counted) or over N + P + B (the rows' positions
    after the shift) reads counted_across_boundaries, naming the count and the fix that counts the labels."""
    n, p, b, _ = _packed_counts()
    assert p > 0 and b > 0  # the window tells the two counts apart
    x = n + b if formula == "N + B" else n + p + b
    name, words = _packed_reading({"blocks": 1 / x})
    assert "counted_across_boundaries" == name, words
    assert f"1/({formula}) = 1/{x} where 1/N is right (N={n})" in words
    assert "count only the labels that are not -100 after the shift" in words


def test_the_packed_rows_real_tokens_stay_a_global_scale_and_the_right_count_reads_correct() -> None:
    """The negative controls: N + P + S (the real tokens, each sequence's first position counted) is the count
    global_scale names; 1/N is correct."""
    n, p, _, s = _packed_counts()
    assert "global_scale" == _packed_reading({"blocks": 1 / (n + p + s)})[0]
    assert "correct" == _packed_reading({"blocks": 1 / n})[0]


def test_labels_rebuilt_across_the_boundaries_and_counted_read_shifted_and_counted_across_boundaries() -> None:
    """The blocks and the boundary pairs at 1/(N + B) read shifted_and_counted_across_boundaries; the same pairs at
    1/N, the batch's count, read shifted_across_boundaries (its negative control)."""
    n, _, b, _ = _packed_counts()
    name, words = _packed_reading({"blocks": 1 / (n + b), "pairs": 1 / (n + b)})
    assert "shifted_and_counted_across_boundaries" == name, words
    assert f"the B={b} pairs across the packed sequences' boundaries" in words and f"1/(N + B) = 1/{n + b}" in words
    assert "keep the batch's labels" in words
    assert "shifted_across_boundaries" == _packed_reading({"blocks": 1 / n, "pairs": 1 / n})[0]


def test_labels_rebuilt_from_the_packed_input_ids_read_their_prompt_and_boundaries_supervised_and_counted() -> None:
    """labels = input_ids over the packed row: the blocks, the prompt positions and the boundary pairs at
    1/(N + P + B)."""
    n, p, b, _ = _packed_counts()
    x = n + p + b
    name, words = _packed_reading({"blocks": 1 / x, "pairs": 1 / x, "prompts": 1 / x})
    assert "shifted_and_counted_across_boundaries" == name, words
    assert f"P={p} prompt positions and the B={b} pairs" in words and f"1/(N + P + B) = 1/{x}" in words


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_a_world_size_twice_applied_reads_as_a_global_scale_in_either_precision(precision: str) -> None:
    n = sum(mb.supervised for rank in UNEVEN for mb in rank)
    weights = [0.5 / n] * sum(len(rank) for rank in UNEVEN)
    assert "global_scale" == reading(hand_evidence(UNEVEN, weights, precision=precision))
