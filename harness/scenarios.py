"""The battery's windows: deterministic layouts of microbatches per rank, built in the parent from the corpus.

``windows[k][rank][microbatch]``: k indexes consecutive optimizer steps. Every rank always has the same number of
microbatches in a window (the recipe contract), but not the same number of rows, lengths or supervised tokens.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import lru_cache

import torch

from harness.batching import IGNORE_INDEX, Microbatch, collate
from harness.config import Config
from harness.corpus import Row, make_corpus
from harness.plan import make_plan

Windows = list[list[list[Microbatch]]]

BATTERY_CONFIG = Config(dropout=0.0)
"""The battery's model and data: the minimum config's, with dropout 0 (the contract's train-mode-without-noise)."""


@lru_cache(maxsize=4)
def _corpus(config: Config) -> tuple[Row, ...]:
    return tuple(make_corpus(config))


def _plan_windows(world_size: int, steps: int, config: Config = BATTERY_CONFIG) -> Windows:
    rows = _corpus(config)
    plan = make_plan(rows, config, world_size=world_size, steps=steps)
    return [[[collate([rows[i] for i in ids]) for ids in rank_ids] for rank_ids in step] for step in plan]


def _unsupervised(mb: Microbatch) -> Microbatch:
    return Microbatch(mb.inputs, torch.full_like(mb.labels, IGNORE_INDEX))


def uneven(world_size: int) -> Windows:
    """One window of the plan: rank r draws from the r-th length band, with prompts and padding."""
    return _plan_windows(world_size, 1)


def balanced(world_size: int) -> Windows:
    """One window where every rank holds exactly the same supervised count (different rows of equal shape)."""
    config = BATTERY_CONFIG
    groups: dict[tuple[int, int], list[Row]] = defaultdict(list)
    for r in _corpus(config):
        if r.split == "train":
            groups[(len(r.tokens), r.prompt_len)].append(r)
    usable = [g for _, g in sorted(groups.items()) if len(g) >= world_size]
    bs, acc = config.batch_size_per_rank, config.accumulation
    if len(usable) < bs * acc:
        msg = f"world_size={world_size}: the corpus has too few rows of equal shape to build a balanced window"
        raise ValueError(msg)
    # Slot j of every rank's window gets a row of the same (length, prompt) shape, a different row on each rank.
    slots = usable[: bs * acc]
    return [[[collate([slots[m * bs + b][rank] for b in range(bs)]) for m in range(acc)] for rank in range(world_size)]]


def one_empty(world_size: int) -> Windows:
    """The uneven window with no supervised token on rank 0 (its rows still run forward and backward)."""
    window = uneven(world_size)[0]
    window[0] = [_unsupervised(mb) for mb in window[0]]
    return [window]


def all_empty(world_size: int) -> Windows:
    """The uneven window with no supervised token on any rank: the global token mean is undefined."""
    return [[[_unsupervised(mb) for mb in rank] for rank in uneven(world_size)[0]]]


def consecutive(world_size: int) -> Windows:
    """Three consecutive windows of the plan, with different token counts in each."""
    return _plan_windows(world_size, 3)


def short_final(world_size: int) -> Windows:
    """Three windows whose last one holds one microbatch per rank instead of two."""
    windows = _plan_windows(world_size, 3)
    windows[-1] = [rank[:1] for rank in windows[-1]]
    return windows


SCENARIOS: dict[str, Callable[[int], Windows]] = {
    "uneven": uneven,
    "balanced": balanced,
    "one_empty": one_empty,
    "all_empty": all_empty,
    "consecutive": consecutive,
    "short_final": short_final,
}


def build(name: str, world_size: int) -> Windows:
    if name not in SCENARIOS:
        msg = f"scenario={name!r} is not one of {sorted(SCENARIOS)}"
        raise ValueError(msg)
    return SCENARIOS[name](world_size)


def token_counts(windows: Windows) -> list[list[int]]:
    """Supervised tokens per window and rank."""
    return [[sum(mb.supervised for mb in rank) for rank in window] for window in windows]
