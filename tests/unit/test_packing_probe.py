"""The packing probe: the same sequences forwarded unpacked and packed; a model whose attention crosses the packed
sequence boundaries is told so, with the fix, and one that keeps them apart is not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from harness.battery.spec import ModelSpec
from harness.diagnosis.packing import LENGTHS, PackingGap, default_sequences, packing_gap
from harness.model import ModelError

CONTROL = "harness.model:crosses_packed_boundaries"


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_the_built_in_model_has_no_packing_gap(precision: str) -> None:
    """The built-in model's packed logits are its unpacked ones: float64 to 1e-12, float32 within the tolerance;
    no note."""
    found = packing_gap(ModelSpec(None, precision=precision).build())
    assert LENGTHS == found.lengths
    assert found.gap < (1e-12 if precision == "fp64" else found.tolerance)
    assert (False, None) == (found.crosses, found.note())


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_the_control_that_attends_across_boundaries_is_reported(precision: str) -> None:
    """crosses_packed_boundaries (plain causal attention over the whole packed row): a gap above 1e-3 and the
    sentence naming it and the fix."""
    found = packing_gap(ModelSpec(CONTROL, precision=precision).build(), name=f"model={CONTROL!r}")
    assert found.crosses and found.gap > 1e-3
    note = found.note()
    assert note is not None
    assert note.startswith("attention crosses packed sequence boundaries: the packed forward's logits differ from "
                           f"the unpacked ones by {found.gap:.1e}")
    assert "use_cache=False" in note and "block-diagonal" in note


class _Strict(nn.Module):
    """The built-in model behind a forward that names its keywords and has no **kwargs: no seq_idx."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ModelSpec(None, precision="fp64").build()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


class _NoPositions(nn.Module):
    """A forward without position_ids: each column is its own position, whatever the row packs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ModelSpec(None, precision="fp64").build()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


def test_a_forward_without_seq_idx_gets_position_ids_only() -> None:
    """seq_idx is passed only to a forward that takes it: a forward naming position_ids alone is called without it,
    and the built-in model behind it finds the sequences from position_ids' restarts."""
    found = packing_gap(_Strict())
    assert found.gap < 1e-12 and found.note() is None


def test_a_forward_without_position_ids_is_refused_with_the_fix() -> None:
    """A model that takes no position_ids cannot be forwarded packed: ModelError naming the model and the fix."""
    with pytest.raises(ModelError, match=r"^model='m:f': its forward takes no position_ids.*use_cache=False"):
        packing_gap(_NoPositions(), name="model='m:f'")


def test_a_forward_that_raises_on_the_packed_row_is_refused_with_its_error() -> None:
    """The model's own error on the packed call, in one line, after the call that raised."""

    class Refuses(_Strict):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None) -> Any:
            if position_ids is not None:
                msg = "no packing here"
                raise RuntimeError(msg)
            return super().forward(input_ids, attention_mask)

    with pytest.raises(ModelError, match=r"model\(input_ids=\.\.\., position_ids=\.\.\.\) on one packed row of "
                                         r"sequences of 5, 11, 3, 8 tokens failed: RuntimeError: no packing here"):
        packing_gap(Refuses())


@pytest.mark.parametrize("sequences", [[torch.arange(1, 4)], [torch.arange(1, 4), torch.ones(2, 2, dtype=torch.int64)],
                                       [torch.arange(1, 4), torch.zeros(0, dtype=torch.int64)]],
                         ids=["one", "two-dimensional", "empty"])
def test_fewer_than_two_sequences_or_bad_shapes_raise(sequences: list[torch.Tensor]) -> None:
    """A packed row holds several non-empty 1-D sequences: anything else is a ValueError naming the shapes."""
    with pytest.raises(ValueError, match="sequences must be two or more non-empty 1-D tensors"):
        packing_gap(ModelSpec(None).build(), sequences)


def test_default_sequences_are_of_different_lengths_and_never_padding() -> None:
    """The default sequences: LENGTHS tokens each, unequal lengths, ids from 1 (PAD is 0), the same on every call."""
    seqs = default_sequences()
    assert LENGTHS == tuple(len(s) for s in seqs) and len(set(LENGTHS)) == len(LENGTHS)
    assert all(int(s.min()) >= 1 for s in seqs)
    assert all(torch.equal(a, b) for a, b in zip(seqs, default_sequences(), strict=True))


def test_a_nan_gap_crosses() -> None:
    """A NaN difference is not within the tolerance."""
    assert PackingGap(float("nan"), 1e-4, LENGTHS).crosses
