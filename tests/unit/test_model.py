"""The tiny causal model: deterministic weights from a private generator, [B, T, V] logits in the config's dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.battery.scenarios import BATTERY_CONFIG
from harness.core.compare import PRECISIONS
from harness.core.formats import shifted_loss_sum
from harness.core.microbatch import IGNORE_INDEX
from harness.data.config import Config
from harness.model import Block, TinyCausalLM, build_model, crosses_packed_boundaries, packed_segments

TINY = Config(d_model=8, n_heads=2, vocab_size=8, max_len=16, min_len=8, prompt_max=4)


def _build(config: Config = TINY, **kwargs: object) -> nn.Module:
    # Only test_build_model_does_not_touch_the_global_torch_rng checks the RNG promise; the other tests fork so that
    # a break of that promise shows up as that one failure, not as a leak in every test of this file.
    with torch.random.fork_rng(devices=[]):
        return build_model(config, **kwargs)  # type: ignore[arg-type]


def _inputs(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, TINY.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- construction ----------------------------------------------------------------------------------------------------


def test_the_model_at_the_battery_size_has_the_parameter_count_its_docstring_gives() -> None:
    """18,944 parameters (harness/model.py's docstring): the components every parity message of the battery counts."""
    assert 18_944 == sum(p.numel() for p in _build(BATTERY_CONFIG).parameters())


def test_build_model_is_deterministic_for_a_seed() -> None:
    """Two models built from the same config have bitwise-equal weights."""
    assert _same_weights(_build(), _build())


def test_build_model_seed_argument_changes_the_weights() -> None:
    """seed= overrides config.seed: another seed gives other weights, the same seed the same ones."""
    assert not _same_weights(_build(), _build(seed=TINY.seed + 1))
    assert _same_weights(_build(seed=TINY.seed + 1), _build(TINY.replace(seed=TINY.seed + 1)))


def test_build_model_does_not_touch_the_global_torch_rng() -> None:
    """Building a model leaves torch's global RNG state exactly as it was (weights come from a private generator)."""
    before = torch.get_rng_state()
    build_model(TINY)
    after = torch.get_rng_state()
    torch.set_rng_state(before)  # restore, so a failure here is reported once, not again by the leak check
    assert torch.equal(before, after)


def test_build_model_weights_do_not_depend_on_the_global_rng() -> None:
    """Advancing the global RNG between two builds changes nothing in the weights."""
    with torch.random.fork_rng(devices=[]):
        first = build_model(TINY)
        torch.rand(1000)
        second = build_model(TINY)
    assert _same_weights(first, second)


@pytest.mark.parametrize(("dropout", "expected"), [(None, 0.1), (0.0, 0.0)], ids=["config-dropout", "dropout0"])
def test_dropout_argument_overrides_the_config(dropout: float | None, expected: float) -> None:
    """dropout=None keeps config.dropout; dropout=0.0 (the battery's setting) turns every dropout off."""
    model = _build(dropout=dropout)
    assert {expected} == {m.p for m in model.modules() if isinstance(m, nn.Dropout)}


# --- forward ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=list(PRECISIONS))
def test_logits_are_batch_by_time_by_vocab_in_the_config_dtype(precision: str) -> None:
    """model(inputs [B, T]) returns logits [B, T, V] whose dtype follows config.precision."""
    model = _build(TINY.replace(precision=precision), dropout=0.0)
    logits = model(_inputs(3, 5))
    assert ((3, 5, TINY.vocab_size), PRECISIONS[precision]) == (tuple(logits.shape), logits.dtype)


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=list(PRECISIONS))
def test_parameters_are_in_the_config_dtype(precision: str) -> None:
    """Every parameter has the dtype of config.precision."""
    model = _build(TINY.replace(precision=precision))
    assert {PRECISIONS[precision]} == {p.dtype for p in model.parameters()}


@pytest.mark.parametrize("position", [0, 4, 9], ids=lambda p: f"pos{p}")
def test_changing_a_later_token_does_not_change_earlier_logits(position: int) -> None:
    """Causal: logits before the changed position are bitwise equal; at the position they change."""
    model = _build(TINY.replace(precision="fp64"), dropout=0.0).eval()
    inputs = _inputs(2, 10)
    changed = inputs.clone()
    changed[:, position] = changed[:, position] % (TINY.vocab_size - 1) + 1
    with torch.no_grad():
        before, after = model(inputs), model(changed)
    assert torch.equal(before[:, :position], after[:, :position])
    assert not torch.equal(before[:, position], after[:, position])


def test_padding_after_a_row_does_not_change_its_logits() -> None:
    """Appending PAD positions leaves the logits of the real positions unchanged (up to float64 rounding)."""
    model = _build(TINY.replace(precision="fp64"), dropout=0.0).eval()
    inputs = _inputs(1, 6)
    padded = torch.cat([inputs, torch.zeros(1, 4, dtype=torch.int64)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded)[:, :6], model(inputs), atol=1e-14, rtol=0.0)


def test_inputs_of_max_len_are_accepted() -> None:
    """T == max_len is the longest valid input."""
    model = _build(dropout=0.0)
    assert (1, TINY.max_len, TINY.vocab_size) == tuple(model(_inputs(1, TINY.max_len)).shape)


def test_inputs_longer_than_max_len_raise() -> None:
    """T > max_len is a ValueError naming max_len and the shape, not an index error in the position embedding."""
    model = _build(dropout=0.0)
    with pytest.raises(ValueError, match=r"max_len=16, got shape \(1, 17\)"):
        model(_inputs(1, TINY.max_len + 1))


def test_one_dimensional_inputs_raise() -> None:
    """Inputs must be [B, T]; a flat sequence is a ValueError."""
    model = _build(dropout=0.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(torch.ones(5, dtype=torch.int64))


def test_position_ids_in_order_give_the_same_logits_and_a_first_chunk_its_part_of_them() -> None:
    """``position_ids`` 0..T-1 are the default, bit for bit; a contiguous first chunk with its positions gives the
    whole sequence's first logits (causal attention: a prefix sees only itself). Its control: a later chunk fed
    without cross-chunk attention (no cp group) is not the whole sequence's, which is why a sharding model gathers."""
    model = build_model(BATTERY_CONFIG).eval()
    x = torch.randint(1, BATTERY_CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    full = model(x)
    at = torch.arange(12).expand(2, 12)
    assert torch.equal(full, model(x, position_ids=at))
    assert torch.allclose(full[:, :5], model(x[:, :5], position_ids=at[:, :5]), atol=1e-6)
    assert not torch.allclose(full[:, 5:], model(x[:, 5:], position_ids=at[:, 5:]), atol=1e-3)
    with pytest.raises(ValueError, match=r"position_ids \(2, 3\) must have the shape of the inputs \(2, 12\)"):
        model(x, position_ids=at[:, :3])


# --- packed rows -----------------------------------------------------------------------------------------------------
# A packed row holds several sequences back to back (transformers' DataCollatorWithFlattening): position_ids restart
# at 0 for each, seq_idx numbers them, no attention mask. The model is right under packing when each sequence's logits
# are the ones it gets alone.

PACKED_LENGTHS = ((3, 7, 5), (6, 1, 4, 4))
"""Two rows of 15 tokens, packed differently: the mask is per row, and a one-token sequence sits between two others."""


def _packed(lengths_per_row: tuple[tuple[int, ...], ...] = PACKED_LENGTHS, seed: int = 1
            ) -> tuple[list[list[torch.Tensor]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the sequences of each row, input_ids, position_ids, seq_idx), every row as long as the others."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [[torch.randint(1, BATTERY_CONFIG.vocab_size, (n,), generator=gen) for n in row] for row in lengths_per_row]
    ids = torch.stack([torch.cat(row) for row in seqs])
    pos = torch.stack([torch.cat([torch.arange(len(s)) for s in row]) for row in seqs])
    idx = torch.stack([torch.cat([torch.full((len(s),), i) for i, s in enumerate(row)]) for row in seqs])
    return seqs, ids, pos, idx


def _unpacked_logits(model: nn.Module, seqs: list[list[torch.Tensor]]) -> torch.Tensor:
    """Each sequence forwarded alone, its logits laid out as in the packed rows: the reference."""
    return torch.stack([torch.cat([model(s.unsqueeze(0))[0] for s in row]) for row in seqs])


def _fp64() -> TinyCausalLM:
    return build_model(BATTERY_CONFIG.replace(precision="fp64")).eval()


@pytest.mark.parametrize("with_seq_idx", [False, True], ids=["position_ids", "position_ids+seq_idx"])
def test_a_packed_row_gives_each_sequence_its_unpacked_logits(with_seq_idx: bool) -> None:
    """Block-diagonal causal attention: every sequence of a packed row (the hf-style call, no attention mask) gets the
    logits it gets alone, float64 to 1e-12 (only the summation order differs), the sequences found from
    position_ids' restarts or given by seq_idx."""
    model = _fp64()
    seqs, ids, pos, idx = _packed()
    extra = {"seq_idx": idx} if with_seq_idx else {}
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, **extra).logits
        torch.testing.assert_close(got, _unpacked_logits(model, seqs), atol=1e-12, rtol=0.0)


def test_seq_idx_keeps_the_sequences_apart_and_wins_over_position_ids() -> None:
    """seq_idx decides the sequences when both are given: position_ids 0..T-1 (no restart) with seq_idx give each
    sequence the logits it gets alone at those positions; the same position_ids without seq_idx (one sequence per
    row, plain causal) do not, which shows the sequences came from seq_idx."""
    model = _fp64()
    seqs, ids, _, idx = _packed()
    at = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        expected = torch.stack([torch.cat([
            model(s.unsqueeze(0), position_ids=at[:1, start:start + len(s)])[0]
            for s, start in zip(row, [0, *torch.tensor([len(s) for s in row]).cumsum(0).tolist()[:-1]])
        ]) for row in seqs])
        torch.testing.assert_close(model(ids, position_ids=at, seq_idx=idx), expected, atol=1e-12, rtol=0.0)
        assert not torch.allclose(model(ids, position_ids=at), expected, atol=1e-3)


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_position_ids_of_one_sequence_per_row_give_the_default_logits_and_gradients_bit_for_bit(precision: str) -> None:
    """position_ids 0..T-1 (one sequence per row) and seq_idx all zeros are plain causal attention: the logits and
    every gradient bitwise equal to the call without them (resume's bit-exactness relies on it)."""
    model = build_model(BATTERY_CONFIG.replace(precision=precision))
    x = torch.randint(1, BATTERY_CONFIG.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    at = torch.arange(20).expand(3, 20)

    def run(**kwargs: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logits = model(x, **kwargs)
        logits.square().sum().backward()
        return [logits.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]

    plain = run()
    for kwargs in ({"position_ids": at}, {"position_ids": at, "seq_idx": torch.zeros_like(at)}):
        assert all(torch.equal(a, b) for a, b in zip(plain, run(**kwargs), strict=True)), kwargs


def test_the_packed_loss_is_the_token_mean_over_its_sequences() -> None:
    """The hf-style call with unshifted labels, -100 at each sequence's first position, and no attention mask: the
    shifted loss over the packed row is the mean over every sequence's targets, as computed on each alone."""
    model = _fp64()
    seqs, ids, pos, _ = _packed(((4, 6, 3),))
    labels = ids.clone()
    labels[0, torch.tensor([0, 4, 10])] = IGNORE_INDEX
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, labels=labels).loss
        total = sum(shifted_loss_sum(model(s.unsqueeze(0)), s.unsqueeze(0)) for s in seqs[0])
    torch.testing.assert_close(got, total / (13 - 3), atol=1e-12, rtol=0.0)


def test_activation_checkpointing_keeps_packed_rows_apart_with_the_same_gradients() -> None:
    """The checkpointed blocks get the sequences too: a packed row's logits and gradients under activation
    checkpointing are bitwise the plain model's (the recomputation runs the same operations)."""
    seqs, ids, pos, idx = _packed()
    grads = []
    for checkpointing in (False, True):
        model = build_model(BATTERY_CONFIG.replace(precision="fp64"), activation_checkpointing=checkpointing)
        model(ids, position_ids=pos, seq_idx=idx).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, position_ids=pos), _unpacked_logits(model, seqs), atol=1e-12, rtol=0.0)


def test_padding_to_a_sequence_multiple_leaves_packed_logits_alone() -> None:
    """Under sequence parallelism the forward pads a row to a multiple of seq_multiple: the padding is after every
    real position (a sequence of its own under seq_idx), so the packed logits are unchanged."""
    model = _fp64()
    seqs, ids, pos, idx = _packed()
    model.seq_multiple = 4  # 15 positions: one column of padding
    with torch.no_grad():
        for extra in ({}, {"seq_idx": idx}):
            torch.testing.assert_close(model(ids, position_ids=pos, **extra), _unpacked_logits(model, seqs),
                                       atol=1e-12, rtol=0.0)


def test_the_control_attends_across_packed_boundaries_and_is_the_model_otherwise() -> None:
    """crosses_packed_boundaries: one sequence per row, the built-in model bit for bit; a packed row, logits off the
    unpacked ones by more than 1e-3 (each later sequence sees those before it), with or without seq_idx."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BATTERY_CONFIG.seed)
        control = crosses_packed_boundaries().double().eval()
    model = _fp64()
    assert _same_weights(model, control)
    seqs, ids, pos, idx = _packed()
    with torch.no_grad():
        assert torch.equal(model(ids), control(ids))
        expected = _unpacked_logits(model, seqs)
        for extra in ({}, {"seq_idx": idx}):
            assert 1e-3 < float((control(ids, position_ids=pos, **extra) - expected).abs().max())


def test_seq_idx_of_another_shape_raises() -> None:
    """seq_idx must be [B, T] like the inputs: a ValueError naming both shapes."""
    _, ids, pos, idx = _packed()
    with pytest.raises(ValueError, match=r"seq_idx \(2, 14\) must have the shape of the inputs \(2, 15\)"):
        _fp64()(ids, position_ids=pos, seq_idx=idx[:, :14])


def test_seq_idx_under_a_cp_group_raises() -> None:
    """A block that gathers over cp masks by positions across ranks, not by sequence: packed rows are refused there
    with the fix, not silently attended across."""
    model = _fp64()
    block = model.blocks[0]
    assert isinstance(block, Block)
    block.cp_group = object()  # refused before any collective
    _, ids, pos, idx = _packed()
    with pytest.raises(ValueError, match="run packed batches without cp"):
        model(ids, position_ids=pos, seq_idx=idx)


def test_packed_segments_start_a_sequence_wherever_the_position_does_not_increase() -> None:
    """Segment ids from position_ids: 0 from the first column, +1 at each restart (a one-token sequence included);
    increasing positions with gaps (a cp rank's load-balanced chunk) are one sequence."""
    got = packed_segments(torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3], [0, 1, 2, 13, 14, 15, 30, 31]]))
    assert [[0, 0, 0, 1, 2, 2, 2, 2], [0] * 8] == got.tolist()
