"""The tiny causal model: deterministic weights from a private generator, [B, T, V] logits in the config's dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.battery.scenarios import BATTERY_CONFIG
from harness.core.compare import PRECISIONS
from harness.data.config import Config
from harness.model import build_model

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
