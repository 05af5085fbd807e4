"""The battery's windows: deterministic layouts of microbatches per rank, built in the parent from the corpus.

``windows[k][rank][microbatch]``: k indexes consecutive optimizer steps. Every rank always has the same number of
microbatches in a window (the recipe contract), but not the same number of rows, lengths or supervised tokens.

Each scenario exists for a mistake the others cannot see; ``harness.recipes.SCENARIO_CONTROLS`` names, for each one,
a negative control that passes every other scenario and fails that one
(``tests/distributed/test_negative_controls.py``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import lru_cache

import torch

from harness.battery.plan.options import MAX_SCENARIO_WORLD_SIZE, MAX_WORLD_SIZE  # noqa: F401 (MAX_WORLD_SIZE: re-exported)
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.data.batching import collate
from harness.data.config import Config
from harness.data.corpus import Row, make_corpus
from harness.data.plan import make_plan

Windows = list[list[list[Microbatch]]]

BATTERY_CONFIG = Config(dropout=0.0)
"""The battery's model and data: the minimum config's, with dropout 0 (the contract's train-mode-without-noise)."""


SMALL_WORLD = 4
"""Up to this world size the scenarios draw from :data:`BATTERY_CONFIG`'s corpus (every figure measured on them);
past it, from :func:`corpus_config`'s."""


def corpus_config(world_size: int) -> Config:
    """The corpus rank r's length band is drawn from: :data:`BATTERY_CONFIG`'s up to :data:`SMALL_WORLD` ranks; for
    more, the same model's corpus with sequences from 3 tokens (prompts up to 2) and ``train_size`` grown with W, so
    that the narrowest band, ``(0, max_len / W]``, still holds a window's rows (up to
    :data:`~harness.battery.plan.options.MAX_SCENARIO_WORLD_SIZE`)."""
    if world_size <= SMALL_WORLD:
        return BATTERY_CONFIG
    grow = -(-world_size // SMALL_WORLD)
    return dataclasses.replace(BATTERY_CONFIG, min_len=3, prompt_max=2, train_size=BATTERY_CONFIG.train_size * grow)


@lru_cache(maxsize=4)
def _corpus(config: Config) -> tuple[Row, ...]:
    return tuple(make_corpus(config))


def _prompt_one_longer(mb: list[Row]) -> None:
    """Give the row of ``mb`` with the most supervised targets a prompt one token longer (no prompt: a prompt of 2,
    since a prompt of 1 masks nothing): one supervised target fewer, the same tokens and shape."""
    i = max(range(len(mb)), key=lambda j: mb[j].supervised)
    if mb[i].supervised > 1:
        mb[i] = dataclasses.replace(mb[i], prompt_len=max(mb[i].prompt_len, 1) + 1)


def _as_real_data_has_them(windows: list[list[list[list[Row]]]]) -> None:
    """Two deterministic edits where the plan's draw falls on a layout that proves less than it should:

    - every scenario holds rows with a prompt as well as rows without (the hf format labels the two differently):
      where the draw holds no prompted row, the last microbatch's longest row gets a prompt;
    - no rank's microbatches all hold one supervised count (a sum of per-microbatch means, or a count taken from one
      microbatch, would be exact on that rank): where they do, the rank's last microbatch's longest row gets a prompt
      one token longer.
    """
    rows = [r for window in windows for rank in window for mb in rank for r in mb]
    if rows and not any(r.prompt_len > 0 and r.supervised > 0 for r in rows):
        _prompt_one_longer(windows[-1][-1][-1])
    for window in windows:
        for rank in window:
            counts = {sum(r.supervised for r in mb) for mb in rank}
            if len(rank) > 1 and len(counts) == 1:
                _prompt_one_longer(rank[-1])


EXTRA_ROWS = 2
"""The most rows a rank's uneven microbatch holds above the scenario's ``rows_per_microbatch``."""


def row_counts(rank: int, microbatches: int, rows: int) -> list[int]:
    """Rows of each of ``rank``'s microbatches: ``rows`` in each, but microbatch ``rank % microbatches`` holds
    +1, -1, +2, -2, ... more (rank 0, 1, 2, 3, ...), within ``[1, rows + EXTRA_ROWS]``.

    Two symmetries a normalization hides behind are broken this way. Microbatches of a rank hold different numbers of
    rows, so a per-microbatch sample-count ratio (``rows_i / rows``) is not ``1/k``; ranks hold different numbers of
    rows, so a sequence mean over a rank's own rows is not the global one."""
    step = 1 + rank // 2
    shift = max(1 - rows, min(EXTRA_ROWS, step if rank % 2 == 0 else -step))
    out = [rows] * microbatches
    out[rank % microbatches] += shift
    return out


def bf16_spacing(n: int) -> int:
    """The gap between neighbouring bfloat16 values around ``n > 0``: 1 up to 256, then doubling at every power of
    two (8 significant bits)."""
    return max(1, 2 ** (n.bit_length() - 8))


def _far_from_the_grid(window: list[list[list[Row]]]) -> None:
    """Give a window of over :data:`BF16_EXACT` supervised tokens a count nearly half a bfloat16 spacing from the
    nearest bfloat16 value (``n % spacing == spacing / 2 - 1``, or odd where the spacing is 2), by giving rows'
    prompts a token more, each on a microbatch where that leaves the rank's counts unequal.

    Such a count is odd, so over :data:`FP16_EXACT` float16 must round it too; and a count rounded to bfloat16 (a
    ``.to(torch.bfloat16)``) is off by ``spacing / 2 - 1`` tokens, 0.1-0.35% of the window: as far as rounding moves
    a count, which is what the bf16 lane's scale test must be able to see (:mod:`harness.battery.prepare.bf16`)."""
    n = sum(r.supervised for rank in window for mb in rank for r in mb)
    if n <= BF16_EXACT:
        return
    spacing = bf16_spacing(n)
    target = max(1, spacing // 2 - 1)
    for _ in range((n - target) % spacing):
        for rank in sorted(window, key=lambda rank: -sum(r.supervised for mb in rank for r in mb)):
            if _one_target_fewer(rank):
                break
        else:
            return  # nothing left to mask without making a rank's counts equal: leave the count as drawn


def _one_target_fewer(rank: list[list[Row]]) -> bool:
    """One supervised target fewer on ``rank`` (the longest row of a microbatch gets a prompt a token longer), on the
    microbatch with the most targets where the rank's microbatches then still hold different counts."""
    order = sorted(range(len(rank)), key=lambda i: -sum(r.supervised for r in rank[i]))
    for i in order:
        edited = list(rank[i])
        _prompt_one_longer(edited)
        counts = [sum(r.supervised for r in m) for m in (*rank[:i], edited, *rank[i + 1:])]
        if sum(r.supervised for r in edited) < sum(r.supervised for r in rank[i]) and (
                len(rank) == 1 or len(set(counts)) > 1):
            rank[i][:] = edited
            return True
    return False


BF16_EXACT = 256
"""bfloat16 holds every integer up to 256 (8 significant bits); above, only multiples of its spacing (2 up to 512,
4 up to 1024, ...)."""

FP16_EXACT = 2048
"""float16 holds every integer up to 2048 (11 significant bits); from 2048 to 4096 only even ones."""


def plan_windows(world_size: int, microbatches: Sequence[int], rows_per_microbatch: int | Sequence[int] | None = None,
                 seed_offset: int = 0) -> Windows:
    """One window per entry of ``microbatches`` (its microbatch count per rank), drawn from the plan: rank r reads
    the r-th length band, with prompts and padding, so ranks and microbatches hold different token counts (made
    sure of by :func:`_as_real_data_has_them`, which also keeps rows with and without a prompt in every scenario),
    different numbers of rows (:func:`row_counts`), and every count over 256 far from bfloat16's grid
    (:func:`_far_from_the_grid`). ``rows_per_microbatch`` is one number for every window, or one per window."""
    return _collated(_drawn_rows(world_size, microbatches, rows_per_microbatch, seed_offset))


def _drawn_rows(world_size: int, microbatches: Sequence[int], rows_per_microbatch: int | Sequence[int] | None,
                seed_offset: int) -> list[list[list[list[Row]]]]:
    """:func:`plan_windows`' rows as the plan draws them, before the edits that keep counts apart."""
    given = rows_per_microbatch or BATTERY_CONFIG.batch_size_per_rank
    rows_each = [given] * len(microbatches) if isinstance(given, int) else list(given)
    corpus = corpus_config(world_size)
    config = dataclasses.replace(
        corpus, accumulation=max(microbatches), seed=BATTERY_CONFIG.seed + seed_offset,
        batch_size_per_rank=max(rows_each) + EXTRA_ROWS,
    )
    rows = _corpus(corpus)
    plan = make_plan(rows, config, world_size=world_size, steps=len(microbatches))
    return [[[[rows[i] for i in ids[:n]] for ids, n in zip(rank_ids, row_counts(r, k, each))]
             for r, rank_ids in enumerate(step)]
            for step, k, each in zip(plan, microbatches, rows_each)]


def _collated(drawn: list[list[list[list[Row]]]]) -> Windows:
    """The drawn rows with counts kept apart (:func:`_as_real_data_has_them`, :func:`_far_from_the_grid`), collated."""
    _as_real_data_has_them(drawn)
    for window in drawn:
        _far_from_the_grid(window)
    return [[[collate(mb) for mb in rank] for rank in window] for window in drawn]


def token_budget(world_size: int) -> Windows:
    """Ranks whose rows a token budget re-splits into different numbers of micro-batches (verl's ``use_dynamic_bsz``,
    :mod:`harness.recipes.dynamic`): two microbatches of about 5 rows per rank, and the longest row of the last
    rank's window swapped for the shortest row of rank 0's first microbatch, so rank 0 holds one long row among
    short ones and the last rank short rows among long ones. At a budget of twice the longest sequence (256 tokens)
    rank 0 runs fewer micro-batches than the last rank (``tests/unit/test_dynamic_microbatches.py``), and each
    micro-batch holds its own count: a loss that divides each micro-batch's mean by this rank's micro-batch count
    weighs every micro-batch alike, and the ranks' micro-batches each by their own rank's count."""
    drawn = _drawn_rows(world_size, [2], 5, seed_offset=5)
    window = drawn[0]
    if world_size > 1:
        first, last = window[0][0], [r for mb in window[-1] for r in mb]
        short = min(range(len(first)), key=lambda i: len(first[i].tokens))
        long_row = max(last, key=lambda r: len(r.tokens))
        for mb in window[-1]:
            if long_row in mb:
                mb[mb.index(long_row)] = first[short]
                break
        first[short] = long_row
    return _collated(drawn)


def unsupervised(mb: Microbatch) -> Microbatch:
    """The same rows with no supervised position: they still run forward and backward, but count for nothing."""
    return Microbatch(mb.inputs, torch.full_like(mb.labels, IGNORE_INDEX))


def uneven(world_size: int) -> Windows:
    """The base window: two microbatches per rank of about 3 rows (:func:`row_counts`), rank r in the r-th length
    band (seed 000's uneven ranks)."""
    return plan_windows(world_size, [2], rows_per_microbatch=3)


def single(world_size: int) -> Windows:
    """One microbatch per rank: first and last at once (a short final window)."""
    return plan_windows(world_size, [1], seed_offset=1)


def long(world_size: int) -> Windows:
    """Five microbatches per rank, each with its own token count: a loop written for two shows here. Its rows per
    microbatch are the fewest (from 2) that put the window over :data:`FP16_EXACT` supervised tokens, an odd count
    (:func:`_far_from_the_grid`), so at every world size one window's count rounds in float16 and in bfloat16."""
    rows = 2
    while True:
        windows = plan_windows(world_size, [5], rows_per_microbatch=rows, seed_offset=2)
        if sum(mb.supervised for rank in windows[0] for mb in rank) > FP16_EXACT:
            return windows
        rows += 1


def varying(world_size: int) -> Windows:
    """Three windows of 3, 2 and 3 microbatches of about 2, 2 and 3 rows, one recipe object and SGD steps between:
    every window's count is far from every other's, so a count kept from one window is wrong on the others by far more
    than a rounding (the same 3 microbatches of the same rows can hold counts 0.3% apart)."""
    return plan_windows(world_size, [3, 2, 3], rows_per_microbatch=[2, 2, 3], seed_offset=3)


def sparse(world_size: int) -> Windows:
    """Four microbatches per rank; microbatch 1 holds no supervised token on any rank, and on rank 1 (rank 0 at W=1)
    neither does the last one. No rank is empty as a whole."""
    window = plan_windows(world_size, [4], rows_per_microbatch=2, seed_offset=4)[0]
    for rank in window:
        rank[1] = unsupervised(rank[1])
    last_empty = 1 if world_size > 1 else 0
    window[last_empty][-1] = unsupervised(window[last_empty][-1])
    for rank in window:  # the microbatches left supervised must still hold different counts (narrow bands, large W)
        kept = [i for i, mb in enumerate(rank) if mb.supervised > 0]
        if len(kept) > 1 and len({rank[i].supervised for i in kept}) == 1:
            rank[kept[-1]] = _first_target_masked(rank[kept[-1]])
    return [window]


def _first_target_masked(mb: Microbatch) -> Microbatch:
    """The same rows with the first supervised position of the row with the most masked, as a prompt one token longer
    would: one supervised target fewer, the same tokens and shape."""
    labels = mb.labels.clone()
    row = int((labels != IGNORE_INDEX).sum(dim=1).argmax())
    first = int((labels[row] != IGNORE_INDEX).nonzero()[0])
    labels[row, first] = IGNORE_INDEX
    return Microbatch(mb.inputs, labels)


def one_empty(world_size: int) -> Windows:
    """The uneven window with no supervised token on rank 0 (its rows still run forward and backward)."""
    window = uneven(world_size)[0]
    window[0] = [unsupervised(mb) for mb in window[0]]
    if not any(bool(((mb.labels[:, 0] == IGNORE_INDEX) & (mb.labels != IGNORE_INDEX).any(dim=1)).any())
               for rank in window for mb in rank):  # rank 0 held the only prompted rows: give the last rank one
        window[-1][-1] = _first_target_masked(window[-1][-1])
    return [window]


def all_empty(world_size: int) -> Windows:
    """The uneven window with no supervised token on any rank: the global token mean is undefined."""
    return [[[unsupervised(mb) for mb in rank] for rank in uneven(world_size)[0]]]


def balanced(world_size: int, microbatches: int | None = None, rows: int | None = None) -> Windows:
    """One window where every rank holds exactly the same supervised count (different rows of equal shape):
    ``microbatches`` of ``rows`` rows per rank (the battery config's accumulation and rows per rank by default).

    Not a battery scenario: it is where the mean of local means is right, kept to show why equal counts prove nothing.
    """
    config = BATTERY_CONFIG
    groups: dict[tuple[int, int], list[Row]] = defaultdict(list)
    for r in _corpus(config):
        if r.split == "train":
            groups[(len(r.tokens), r.prompt_len)].append(r)
    usable = [g for _, g in sorted(groups.items()) if len(g) >= world_size]
    bs, acc = rows or config.batch_size_per_rank, microbatches or config.accumulation
    if len(usable) < bs * acc:
        msg = f"world_size={world_size}: the corpus has too few rows of equal shape to build a balanced window"
        raise ValueError(msg)
    # Slot j of every rank's window gets a row of the same (length, prompt) shape, a different row on each rank.
    slots = usable[: bs * acc]
    return [[[collate([slots[m * bs + b][rank] for b in range(bs)]) for m in range(acc)] for rank in range(world_size)]]


SCENARIOS: dict[str, Callable[[int], Windows]] = {
    "uneven": uneven,
    "single": single,
    "long": long,
    "varying": varying,
    "sparse": sparse,
    "one_empty": one_empty,
    "all_empty": all_empty,
    "balanced": balanced,
    "token_budget": token_budget,
}

BATTERY_SCENARIOS = ("uneven", "single", "long", "varying", "sparse", "one_empty", "all_empty", "token_budget")
"""The scenarios every recipe under test runs through (``balanced`` only documents a blind spot); ``--quick`` runs
three of them (:data:`harness.battery.plan.selection.QUICK_SCENARIOS`)."""

MULTI_RANK_ONLY = frozenset({"one_empty"})
"""Scenarios that need two ranks or more (one empty rank of one is every rank: that is ``all_empty``)."""


def build(name: str, world_size: int) -> Windows:
    if name not in SCENARIOS:
        msg = f"scenario={name!r} is not one of {sorted(SCENARIOS)}"
        raise ValueError(msg)
    if not 1 <= world_size <= MAX_SCENARIO_WORLD_SIZE:
        msg = f"world_size={world_size!r} must be between 1 and {MAX_SCENARIO_WORLD_SIZE} for the battery's scenarios"
        raise ValueError(msg)
    return SCENARIOS[name](world_size)
