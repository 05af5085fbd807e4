"""Gradient properties on real ranks: Hypothesis draws the token layout (world size 1 to 4, microbatches per rank,
sequence and prompt lengths, empty ranks), the battery's parity check must hold for the correct recipe, and a search
over the same layouts must find out the mean of local means.

Every example is one warm launch through ``run_windows`` (tens to hundreds of milliseconds), so the quick profile
draws a handful of layouts; ``HARNESS_HYPOTHESIS_PROFILE=thorough`` draws hundreds. A failure prints the layout in
the form of :class:`Layout`'s repr: per rank, per microbatch, each row's length, prompt length and supervised count.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import Phase, assume, given, note, settings
from hypothesis import strategies as st

from harness.testing.hypothesis_profiles import load_profile, max_examples

load_profile()

from harness.battery.judge import checks  # noqa: E402
from harness.battery.judge.verdict import Verdict  # noqa: E402
from harness.battery.launch import runner  # noqa: E402
from harness.battery.scenarios import BATTERY_CONFIG, Windows  # noqa: E402
from harness.data.batching import collate  # noqa: E402
from harness.data.corpus import Row  # noqa: E402


@dataclass(frozen=True)
class Layout:
    """One window: ``ranks[rank][microbatch]`` is a tuple of rows, each ``(length, prompt_len)``."""

    ranks: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    offset: int
    """Shifts the token pattern, so equal shapes still carry different tokens."""

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def supervised(self) -> int:
        return sum(_sup(length, p) for rank in self.ranks for mb in rank for length, p in mb)

    def __repr__(self) -> str:
        lines = [f"Layout(world {self.world_size}, {self.supervised} supervised tokens, offset {self.offset}:"]
        for r, rank in enumerate(self.ranks):
            mbs = "; ".join(
                f"mb{m}: " + ", ".join(f"len {length} prompt {p} sup {_sup(length, p)}" for length, p in mb)
                for m, mb in enumerate(rank)
            )
            lines.append(f"  rank {r} ({sum(_sup(n, p) for mb in rank for n, p in mb)} sup): {mbs}")
        return "\n".join(lines) + ")"

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        # Hypothesis prints dataclasses field by field; the falsifying example should read like the repr above.
        printer.text(repr(self))  # type: ignore[attr-defined]

    def windows(self) -> Windows:
        """The layout as ``run_windows`` takes it: one window, real rows collated into microbatches."""
        vocab = BATTERY_CONFIG.vocab_size - 1
        window = []
        for r, rank in enumerate(self.ranks):
            mbs = []
            for m, mb in enumerate(rank):
                rows = [
                    Row(i, "train", tuple(1 + (self.offset + 7 * r + 5 * m + 3 * i + 2 * t) % vocab
                                          for t in range(length)), p)
                    for i, (length, p) in enumerate(mb)
                ]
                mbs.append(collate(rows))
            window.append(mbs)
        return [window]


def _sup(length: int, prompt: int) -> int:
    return length - max(prompt, 1)  # Row.supervised


@st.composite
def layouts(draw: st.DrawFn, max_world: int = 4) -> Layout:
    """A window of the recipe contract: every rank the same number of microbatches, each with at least one row;
    lengths 2..12, prompts up to the whole row; some ranks drawn empty (every prompt covers its row)."""
    world = draw(st.integers(1, max_world))
    per_rank = draw(st.integers(1, 2))
    ranks = []
    for _ in range(world):
        empty = draw(st.booleans()) if world > 1 else False
        mbs = []
        for _ in range(per_rank):
            rows = []
            for _ in range(draw(st.integers(1, 2))):
                length = draw(st.integers(2, 12))
                prompt = length if empty else draw(st.integers(0, length))
                rows.append((length, prompt))
            mbs.append(tuple(rows))
        ranks.append(tuple(mbs))
    layout = Layout(tuple(ranks), draw(st.integers(0, 30)))
    # A window without any supervised token is a separate contract (every rank raises); battery tests cover it.
    assume(layout.supervised > 0)
    return layout


def _parity(recipe: str, layout: Layout) -> Verdict:
    return checks.parity(runner.run_windows(recipe, layout.windows(), deadline=20))


@settings(max_examples=max_examples(multi=True))
@given(layouts())
def test_the_correct_recipe_matches_the_reference_on_any_layout(layout: Layout) -> None:
    """For any drawn layout, the global-token-mean recipe's DDP gradient equals the single-device reference."""
    note(repr(layout))
    verdict = _parity("harness.recipes:global_token_mean", layout)
    assert verdict.passed, verdict.message


def test_a_search_finds_a_layout_that_refutes_the_mean_of_local_means() -> None:
    """Negative control: the same property asked of the mean of local means is refuted within 20 generated layouts
    (no shrinking: a control only has to be found out, not minimized), and the report shows the layout."""

    @settings(phases=[Phase.generate], max_examples=20, database=None, derandomize=True, report_multiple_bugs=False)
    @given(layouts())
    def claim(layout: Layout) -> None:
        verdict = _parity("harness.recipes:mean_of_local_means", layout)
        assert verdict.passed, verdict.message

    with pytest.raises(AssertionError) as info:
        claim()
    assert "check parity FAILED" in str(info.value)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "Layout(world" in notes and "rank 1" in notes, notes


def test_the_layout_repr_names_every_rank_microbatch_and_count() -> None:
    """The failure report's layout is readable: per rank, per microbatch, length, prompt and supervised count."""
    layout = Layout(((((5, 0),),), (((3, 3),),)), 0)
    assert (
        "Layout(world 2, 4 supervised tokens, offset 0:\n"
        "  rank 0 (4 sup): mb0: len 5 prompt 0 sup 4\n"
        "  rank 1 (0 sup): mb0: len 3 prompt 3 sup 0)"
    ) == repr(layout)
