"""Arithmetic properties of the denominator, over arbitrary rank counts, loss sums and counts (zeros included).

The seeds' worked cases (``test_arithmetic.py``) are the points someone thought of; here Hypothesis draws the rest.
Sums and counts are exact fractions where the property is exact, so a failure is the arithmetic, never rounding.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import Phase, given, note, settings
from hypothesis import strategies as st

from harness.testing.hypothesis_profiles import load_profile, max_examples

load_profile()

from harness import global_token_loss, loss_sum  # noqa: E402  (after the profile, as every property module)
from harness.core.loss import mean_of_means, token_mean  # noqa: E402
from harness.data.batching import collate  # noqa: E402
from harness.data.config import Config  # noqa: E402
from harness.data.corpus import Row  # noqa: E402
from harness.model import build_model  # noqa: E402

# Per-rank (loss sum, supervised count): a rank may hold no token at all (0, 0); a sum is >= 0 as cross-entropy is.
rank_stats = st.tuples(st.integers(0, 10_000), st.integers(0, 500)).map(
    lambda sc: (sc[0] if sc[1] else 0, sc[1])  # no token, no loss
)
layouts = st.lists(rank_stats, min_size=1, max_size=8).filter(lambda rs: sum(c for _, c in rs) > 0)


def _global_mean(ranks: list[tuple[int, int]]) -> Fraction:
    """The harness's token mean, in exact arithmetic."""
    return token_mean([Fraction(s) for s, _ in ranks], [c for _, c in ranks])


def _mean_of_means(ranks: list[tuple[int, int]]) -> Fraction:
    """The harness's mean of local means, in exact arithmetic."""
    return mean_of_means([Fraction(s) for s, _ in ranks], [c for _, c in ranks])


@given(layouts)
def test_the_rank_average_of_global_token_losses_is_the_global_token_mean(ranks: list[tuple[int, int]]) -> None:
    """For any ranks, DDP's average over W of ``global_token_loss(S_r, N, W)`` is ``sum(S_r) / N``."""
    world = len(ranks)
    total = sum(c for _, c in ranks)
    scaled = [global_token_loss(torch.tensor(float(s), dtype=torch.float64), total, world) for s, _ in ranks]
    got = float(sum(scaled)) / world
    assert float(_global_mean(ranks)) == pytest.approx(got, rel=1e-12, abs=1e-12)


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=8), st.integers(1, 500))
def test_the_mean_of_means_equals_the_global_mean_when_counts_are_equal(sums: list[int], count: int) -> None:
    """Equal counts on every rank make the mean of local means the global token mean: why balanced fixtures hide it."""
    ranks = [(s, count) for s in sums]
    assert _global_mean(ranks) == _mean_of_means(ranks)


@given(st.lists(st.integers(1, 500), min_size=1, max_size=8), st.integers(0, 50))
def test_the_mean_of_means_equals_the_global_mean_when_local_means_are_equal(counts: list[int], mean: int) -> None:
    """Equal local means make any weighting give the same answer, whatever the counts."""
    ranks = [(mean * c, c) for c in counts]
    assert _global_mean(ranks) == _mean_of_means(ranks)


@given(st.tuples(st.integers(0, 10_000), st.integers(1, 500)), st.tuples(st.integers(0, 10_000), st.integers(1, 500)))
def test_the_mean_of_means_differs_on_two_ranks_with_different_counts_and_means(
    a: tuple[int, int], b: tuple[int, int]
) -> None:
    """On two ranks the gap is ``(m_a - m_b)(c_b - c_a) / (2 (c_a + c_b))``: zero only for equal counts or means."""
    (sa, ca), (sb, cb) = a, b
    ma, mb = Fraction(sa, ca), Fraction(sb, cb)
    gap = _mean_of_means([a, b]) - _global_mean([a, b])
    assert (ma - mb) * (cb - ca) / (2 * (ca + cb)) == gap
    assert (gap == 0) == (ca == cb or ma == mb)


def test_the_mean_of_means_is_found_out_by_a_search() -> None:
    """Negative control: asked to prove "mean of means == global mean" for all layouts, Hypothesis finds a layout
    that refutes it within a few dozen generated examples (no shrinking)."""

    @settings(phases=[Phase.generate], max_examples=200, database=None, derandomize=True)
    @given(layouts.filter(lambda rs: all(c > 0 for _, c in rs)))
    def claim(ranks: list[tuple[int, int]]) -> None:
        assert _global_mean(ranks) == _mean_of_means(ranks)

    with pytest.raises(AssertionError):
        claim()


# --- Splitting a window into microbatches, through the real loss on the real model --------------------------------

TINY = Config(d_model=8, n_heads=2, vocab_size=8, max_len=16, min_len=4, prompt_max=3)
_MODEL = None


def _model() -> torch.nn.Module:
    # Built once, lazily (collection stays cheap); build_model draws from a private generator.
    global _MODEL
    if _MODEL is None:
        _MODEL = build_model(TINY).eval()
    return _MODEL


@st.composite
def rows_and_split(draw: st.DrawFn) -> tuple[list[Row], list[int]]:
    """Rows of lengths 2..16 with prompts (some with no supervised token), and the sizes of a split into
    microbatches of at least one row each."""
    n = draw(st.integers(1, 6))
    rows = []
    for i in range(n):
        length = draw(st.integers(2, TINY.max_len))
        prompt = draw(st.integers(0, length))
        tokens = tuple(draw(st.lists(st.integers(1, TINY.vocab_size - 1), min_size=length, max_size=length)))
        rows.append(Row(i, "train", tokens, prompt))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    return rows, sizes


# Each example runs the model a few times (~20 ms a forward on a busy 2-core machine): the multi-rank budget.
@settings(max_examples=max_examples(multi=True))
@given(rows_and_split(), st.integers(1, 4))
def test_splitting_a_window_into_microbatches_never_changes_the_loss(
    case: tuple[list[Row], list[int]], world: int
) -> None:
    """However the rows are cut into microbatches (and padded to each one's longest row), the summed loss, the
    supervised count and the scaled loss ``W * S / N`` are those of the whole window in one microbatch."""
    rows, sizes = case
    note(f"rows (length, prompt_len, supervised): {[(len(r.tokens), r.prompt_len, r.supervised) for r in rows]}; "
         f"microbatch sizes {sizes}")
    whole = collate(rows)
    total = whole.supervised
    parts, start = [], 0
    for size in sizes:
        parts.append(collate(rows[start : start + size]))
        start += size
    assert total == sum(mb.supervised for mb in parts)
    model = _model()
    with torch.no_grad():
        s_whole = loss_sum(model(whole.inputs), whole.labels)
        s_parts = sum(loss_sum(model(mb.inputs), mb.labels) for mb in parts)
    # Padding only follows a row's end and the model is causal, so padding never changes a supervised logit: the
    # only difference is float32 summation order.
    torch.testing.assert_close(s_whole, s_parts, atol=1e-4, rtol=1e-5)
    if total:
        torch.testing.assert_close(
            global_token_loss(s_whole, total, world), global_token_loss(s_parts, total, world), atol=1e-4, rtol=1e-5
        )


def test_dividing_each_microbatch_by_its_own_count_is_found_out_by_a_search() -> None:
    """Negative control: the per-microbatch mean (a split-dependent normalization) is refuted by some split."""

    @settings(phases=[Phase.generate], max_examples=200, database=None, derandomize=True)
    @given(st.lists(st.tuples(st.integers(0, 100), st.integers(1, 20)), min_size=2, max_size=6))
    def claim(microbatches: list[tuple[int, int]]) -> None:
        per_mb = mean_of_means([Fraction(s) for s, _ in microbatches], [c for _, c in microbatches])
        assert _global_mean(microbatches) == per_mb

    with pytest.raises(AssertionError):
        claim()


# --- The profiles themselves ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, "quick"), ({"CI": "true"}, "ci"), ({"HARNESS_HYPOTHESIS_PROFILE": "thorough", "CI": "true"}, "thorough")],
    ids=["default-quick", "ci-when-CI-is-true", "variable-wins-over-CI"],
)
def test_the_profile_is_chosen_by_one_variable(
    env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HARNESS_HYPOTHESIS_PROFILE picks the profile; unset, CI=true means the derandomized ci profile."""
    from harness.testing.hypothesis_profiles import profile_name

    for key in ("HARNESS_HYPOTHESIS_PROFILE", "CI"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert expected == profile_name()


def test_an_unknown_profile_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt profile is an error naming the variable and the choices, not a silent default."""
    from harness.testing.hypothesis_profiles import profile_name

    monkeypatch.setenv("HARNESS_HYPOTHESIS_PROFILE", "nightly")
    with pytest.raises(ValueError, match="HARNESS_HYPOTHESIS_PROFILE='nightly'"):
        profile_name()
