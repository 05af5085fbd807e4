"""What the torchrun battery (:mod:`harness.battery.dist`) keeps in torchrun's store: a client of it under the
battery's own key prefix, values put and waited for, and each rank's window notices
(:func:`harness.distributed.launcher.progress`) published per run, so that a failed run's owner reads every rank's
record before the abort's text (:mod:`harness.distributed.divergence`)."""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from harness.distributed.divergence import StepReport

STORE_SLACK = 15.0
"""Seconds past the deadline a worker waits on the store for a peer's result before it gives up on the peer."""


def connect(deadline: float) -> dist.Store:
    """A client of torchrun's store, under the battery's own key prefix."""
    world = dist.get_world_size()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=deadline + STORE_SLACK))
    return dist.PrefixStore(f"harness.battery/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/", store)


def put(store: dist.Store, key: str, value: object) -> None:
    store.set(key, pickle.dumps(value))  # type: ignore[arg-type]  # the store takes bytes; its stub says str


def get(store: dist.Store, key: str, deadline: float) -> Any:
    store.wait([key], datetime.timedelta(seconds=deadline + STORE_SLACK))
    return pickle.loads(store.get(key))


class StoreChannel:
    """:func:`harness.distributed.launcher.progress` in a torchrun worker: each window's notice (what the rank did, the
    synchronizations it ran) published to the store under the run, as the in-process launcher's pipe carries it, so
    that the run's owner reads every rank's record when the run fails, whatever ended it
    (:mod:`harness.distributed.divergence`)."""

    def __init__(self, store: dist.Store, run: int, rank: int) -> None:
        self.store, self.key, self.within = store, f"{run}/steps{rank}", f"{run}/within{rank}"
        self.history: dict[int, tuple[str, int | None]] = {}

    def notice(self, step: int, note: str, collectives: int | None = None, *, finished: bool = True) -> None:
        if not finished:  # still in the step: only the last such report counts
            put(self.store, self.within, (step, note, collectives))
            return
        self.history[step] = (note, collectives)
        put(self.store, self.key, self.history)


@contextlib.contextmanager
def reporting(store: dist.Store, run: int, rank: int) -> Iterator[None]:
    from harness.distributed import rank as rank_module

    before = rank_module.CHANNEL
    rank_module.CHANNEL = StoreChannel(store, run, rank)  # type: ignore[assignment]
    try:
        yield
    finally:
        rank_module.CHANNEL = before


def histories(store: dist.Store, run: int, world: int) -> dict[int, dict[int, StepReport]]:
    """Every rank's published notices of run ``run`` (none for a rank that published none)."""
    out: dict[int, dict[int, StepReport]] = {}
    for r in range(world):
        key = f"{run}/steps{r}"
        seen = pickle.loads(store.get(key)) if store.check([key]) else {}
        out[r] = {step: StepReport(note, count) for step, (note, count) in seen.items()}
    return out


def working(store: dist.Store, run: int, world: int) -> dict[int, tuple[int, StepReport]]:
    """Every rank's last report from inside a step of run ``run``, ``(step, report)`` (none for a rank that sent
    none)."""
    out: dict[int, tuple[int, StepReport]] = {}
    for r in range(world):
        key = f"{run}/within{r}"
        if store.check([key]):
            step, note, count = pickle.loads(store.get(key))
            out[r] = (step, StepReport(note, count, finished=False))
    return out


__all__ = ["STORE_SLACK", "StoreChannel", "connect", "get", "histories", "put", "reporting", "working"]
