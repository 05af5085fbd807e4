"""The library recipes' own helpers, without their libraries: ``generators_kept`` puts back every global generator a
constructor moved (``Trainer.__init__`` seeds them all with ``set_seed``)."""

from __future__ import annotations

import random

import numpy as np
import torch

from harness.battery.rank.rank_watch import moved, rng_states
from harness.recipes import generators_kept


def _seed_everything(seed: int) -> None:
    """What ``transformers.trainer_utils.set_seed`` does to the global generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_generators_kept_puts_back_every_global_generator_a_seeding_call_moved() -> None:
    before = rng_states()
    with generators_kept():
        _seed_everything(42)
    assert () == moved(before, rng_states())


def test_a_seeding_call_outside_generators_kept_moves_all_three() -> None:
    """The negative control: the same call, unguarded, moves what the hygiene check watches."""
    state = rng_states()
    try:
        before = rng_states()
        _seed_everything(42)
        assert ("python random", "numpy", "torch CPU") == moved(before, rng_states())
    finally:
        random.setstate(state["python random"])  # type: ignore[arg-type]
        np.random.set_state(state["numpy"])  # type: ignore[arg-type]
        torch.set_rng_state(state["torch CPU"])  # type: ignore[arg-type]


def test_generators_kept_restores_them_when_the_block_raises() -> None:
    before = rng_states()
    try:
        with generators_kept():
            _seed_everything(7)
            raise RuntimeError("a constructor that failed after seeding")
    except RuntimeError:
        pass
    assert () == moved(before, rng_states())
