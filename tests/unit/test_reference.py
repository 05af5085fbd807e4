"""reference_gradient: the single-device gradient of total loss sum / total supervised count, on a private copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import IGNORE_INDEX, Microbatch
from harness.core.compare import flat_grad
from harness.core.reference import reference_gradient
from harness.data.batching import collate
from harness.data.config import Config
from harness.data.corpus import Row, make_corpus
from harness.model import build_model

TINY = Config(
    d_model=8,
    n_heads=2,
    vocab_size=8,
    max_len=16,
    min_len=8,
    prompt_max=4,
    precision="fp64",
    train_size=9,
    val_size=1,
    test_size=1,
    prompt_fraction=0.5,
)
# float64 on both paths: the only difference is summation order (per microbatch, then across backward passes),
# which costs a few ulps of values of order 0.1.
ATOL, RTOL = 1e-12, 1e-9


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return [r for r in make_corpus(TINY) if r.split == "train"]


@pytest.fixture
def model() -> nn.Module:
    # build_model must not touch the global RNG; test_model.py checks that on its own, so forking here keeps a
    # failure there from turning every reference test red through the leak check.
    with torch.random.fork_rng(devices=[]):
        return build_model(TINY, dropout=0.0)


def _direct(model: nn.Module, rows: list[Row]) -> tuple[torch.Tensor, float, int]:
    """Gradient of the global token mean in one autograd pass over every row padded into one batch, without loss_sum."""
    mb = collate(rows)
    mask = mb.labels != IGNORE_INDEX
    logp = model(mb.inputs).log_softmax(dim=-1)
    picked = logp.gather(-1, mb.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    count = int(mask.sum())
    loss = -(picked * mask).sum() / count
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads]), float(loss.detach()), count


def _windows(rows: list[Row], world: int, per_mb: int) -> list[list[Microbatch]]:
    """Deal the rows to ``world`` ranks, each rank's rows cut into microbatches of ``per_mb`` rows."""
    dealt = [rows[r::world] for r in range(world)]
    return [[collate(rank_rows[i : i + per_mb]) for i in range(0, len(rank_rows), per_mb)] for rank_rows in dealt]


def test_the_tiny_rows_include_prompts_and_different_lengths(rows: list[Row]) -> None:
    """The fixture exercises what the denominator must get right: prompts and padding."""
    assert any(r.prompt_len > 1 for r in rows)
    assert len({len(r.tokens) for r in rows}) > 1


def test_reference_equals_the_direct_global_token_mean_gradient(model: nn.Module, rows: list[Row]) -> None:
    """Two ranks of two-row microbatches give the gradient of (total loss sum) / (total count) in one pass."""
    expected, _, _ = _direct(model, rows)
    ref = reference_gradient(model, _windows(rows, 2, 2))
    torch.testing.assert_close(ref.gradient, expected, atol=ATOL, rtol=RTOL)


def test_reference_loss_and_tokens_are_the_global_token_mean(model: nn.Module, rows: list[Row]) -> None:
    """Reference.loss is total loss sum / total count and Reference.tokens the total count."""
    _, loss, count = _direct(model, rows)
    ref = reference_gradient(model, _windows(rows, 2, 2))
    assert (count, sum(r.supervised for r in rows)) == (ref.tokens, ref.tokens)
    assert pytest.approx(loss, rel=RTOL) == ref.loss


def test_reference_gradient_is_float64_for_an_fp64_model(model: nn.Module, rows: list[Row]) -> None:
    """The reference keeps the model's dtype, so the strict lane compares float64 with float64."""
    assert torch.float64 == reference_gradient(model, _windows(rows, 1, 9)).gradient.dtype


@pytest.mark.parametrize(
    ("world", "per_mb"),
    [(1, 9), (1, 2), (2, 3), (3, 1), (3, 2)],
    ids=["ranks1-mb9", "ranks1-mb2", "ranks2-mb3", "ranks3-mb1", "ranks3-mb2"],
)
def test_any_split_of_the_rows_gives_the_same_reference(
    model: nn.Module, rows: list[Row], world: int, per_mb: int
) -> None:
    """Dealing the same rows to 1, 2 or 3 ranks, in any microbatch size, leaves the reference gradient unchanged."""
    one_pass = reference_gradient(model, [[collate(rows)]]).gradient
    torch.testing.assert_close(
        reference_gradient(model, _windows(rows, world, per_mb)).gradient, one_pass, atol=ATOL, rtol=RTOL
    )


def test_reference_differs_from_the_mean_of_rank_means(model: nn.Module, rows: list[Row]) -> None:
    """Negative control: the average of the ranks' own mean gradients is not the reference on uneven ranks."""
    windows = [rows[:2], rows[2:]]
    rank_means = torch.stack([_direct(model, w)[0] for w in windows]).mean(dim=0)
    ref = reference_gradient(model, [[collate(w)] for w in windows]).gradient
    assert (ref - rank_means).abs().max() > 1e3 * ATOL


# --- the model is left untouched -------------------------------------------------------------------------------------


def test_reference_does_not_change_weights_or_grad(model: nn.Module, rows: list[Row]) -> None:
    """The caller's weights and its (non-zero) .grad are exactly as they were."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference_gradient(model, _windows(rows, 2, 2))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.full_like(flat_grad(model), 7.0), flat_grad(model))


def test_reference_leaves_missing_grads_missing(model: nn.Module, rows: list[Row]) -> None:
    """A model without .grad still has none afterwards: the backward ran on a copy."""
    reference_gradient(model, _windows(rows, 2, 2))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("training", [True, False], ids=["train-mode", "eval-mode"])
def test_reference_keeps_the_model_mode(model: nn.Module, rows: list[Row], training: bool) -> None:
    """The caller's train/eval mode is unchanged."""
    model.train(training)
    reference_gradient(model, _windows(rows, 2, 2))
    assert [training] * len(list(model.modules())) == [m.training for m in model.modules()]


def test_reference_unwraps_a_module_attribute(model: nn.Module, rows: list[Row]) -> None:
    """A wrapper with ``.module`` (as DDP has) gives the inner model's reference."""
    wrapper = nn.Module()
    wrapper.module = model
    windows = _windows(rows, 2, 2)
    torch.testing.assert_close(
        reference_gradient(wrapper, windows).gradient, reference_gradient(model, windows).gradient, atol=0.0, rtol=0.0
    )


# --- invalid windows -------------------------------------------------------------------------------------------------


def _unsupervised(b: int = 2, t: int = 5) -> Microbatch:
    return Microbatch(torch.ones(b, t, dtype=torch.int64), torch.full((b, t), IGNORE_INDEX, dtype=torch.int64))


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"ranks{w}")
def test_windows_without_supervised_tokens_raise(model: nn.Module, world: int) -> None:
    """No supervised token on any rank: the global token mean is undefined, a ValueError."""
    with pytest.raises(ValueError, match="no supervised token"):
        reference_gradient(model, [[_unsupervised(), _unsupervised(1, 3)] for _ in range(world)])


def test_one_empty_rank_still_has_a_reference(model: nn.Module, rows: list[Row]) -> None:
    """A rank with no supervised token adds nothing: the reference is that of the other rank alone."""
    alone = reference_gradient(model, [[collate(rows[:3])]]).gradient
    with_empty = reference_gradient(model, [[collate(rows[:3])], [_unsupervised()]]).gradient
    torch.testing.assert_close(with_empty, alone, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("windows", [[], [[]]], ids=["no-ranks", "empty-rank"])
def test_windows_without_microbatches_raise(model: nn.Module, windows: list[list[Microbatch]]) -> None:
    """No rank, or a rank without a microbatch, is a ValueError."""
    with pytest.raises(ValueError, match="at least one"):
        reference_gradient(model, windows)


def test_windows_of_non_microbatches_raise(model: nn.Module) -> None:
    """Anything but a Microbatch in a window is a TypeError naming the type."""
    with pytest.raises(TypeError, match="tuple"):
        reference_gradient(model, [[(torch.ones(1, 3, dtype=torch.int64),) * 2]])  # type: ignore[list-item]
