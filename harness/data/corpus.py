"""Deterministic synthetic corpus and its data lock.

Each sequence follows a simple arithmetic pattern (``token[t+1] = token[t] + stride`` over the ids
``1 .. vocab_size - 1``) with a little noise, so a small causal model can learn it and a trained model's test
loss means something. Some sequences start with an unsupervised prompt prefix: a sequence's length is then not
its supervised count, which is exactly the distinction the denominator must get right.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from harness.data.config import Config

SPLITS = ("train", "val", "test")

# The fields of Config that change the generated data. The data lock covers them and the data itself,
# so a resume or an outputs folder made from other data is refused.
CORPUS_FIELDS = (
    "seed", "train_size", "val_size", "test_size", "min_len", "max_len", "vocab_size",
    "prompt_fraction", "prompt_max", "noise",
)


@dataclass(frozen=True, slots=True)
class Row:
    """One sequence. ``tokens[:prompt_len]`` is the prompt: those tokens are never a supervised target."""

    id: int
    split: str
    tokens: tuple[int, ...]
    prompt_len: int

    @property
    def supervised(self) -> int:
        """Supervised targets: every next-token position whose target lies after the prompt."""
        return len(self.tokens) - max(self.prompt_len, 1)


def make_corpus(config: Config) -> list[Row]:
    """All rows of every split, ids ``0 ..`` in split order; the same config gives the same rows."""
    if not isinstance(config, Config):
        msg = f"config must be a harness.Config, got {type(config).__name__}"
        raise TypeError(msg)
    rng = random.Random(config.seed)
    n_ids = config.vocab_size - 1
    rows: list[Row] = []
    sizes = (config.train_size, config.val_size, config.test_size)
    for split, size in zip(SPLITS, sizes):
        for _ in range(size):
            length = rng.randint(config.min_len, config.max_len)
            stride = rng.randint(1, 3)
            start = rng.randrange(n_ids)
            tokens = []
            for t in range(length):
                if rng.random() < config.noise:
                    tokens.append(1 + rng.randrange(n_ids))
                else:
                    tokens.append(1 + (start + stride * t) % n_ids)
            prompt = rng.randint(2, config.prompt_max) if rng.random() < config.prompt_fraction else 0
            rows.append(Row(id=len(rows), split=split, tokens=tuple(tokens), prompt_len=prompt))
    return rows


def split_rows(rows: Sequence[Row], split: str) -> list[Row]:
    if split not in SPLITS:
        msg = f"split={split!r} must be one of {SPLITS}"
        raise ValueError(msg)
    return [r for r in rows if r.split == split]


def data_lock(rows: Sequence[Row], config: Config) -> str:
    """SHA-256 over the config fields that shape the data and every row, in order."""
    h = hashlib.sha256()
    shape = {k: getattr(config, k) for k in CORPUS_FIELDS}
    h.update(json.dumps(shape, sort_keys=True).encode())
    for r in rows:
        h.update(json.dumps([r.id, r.split, r.prompt_len, list(r.tokens)]).encode())
    return h.hexdigest()
