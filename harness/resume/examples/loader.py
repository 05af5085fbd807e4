"""A data-parallel loop written another way: a ``DataLoader`` with worker processes, ``torch.distributed.checkpoint``
saving with ``overwrite=False``, each rank's state in a folder of its own made with ``mkdir()``, numpy's generator
state returned as numpy arrays. Nothing from the harness.

``--trainer=harness.resume.examples.loader:build``. What it holds, and why each piece matters to a resume:

* a small MLP under ``DistributedDataParallel`` with its defaults, AdamW (two moment buffers and a step count per
  parameter) and a cosine schedule;
* a ``DataLoader`` with two worker processes over a sampler that starts where the rank's data position says: the
  position is the epoch and the batch within it, and a resume starts the epoch's iterator at that batch rather than
  at its first. The loader gets a generator of its own, seeded by the epoch: its workers' seeds are then drawn from
  it, not from torch's global generator, which a resumed run would otherwise draw from once more than the run that
  never stopped (it builds an iterator the other did not);
* a scale jitter drawn from numpy's global generator, whose state (``np.random.get_state()``, a tuple holding a
  numpy array) is saved and returned by ``state()`` as it is; Python's and torch's global generators are saved and
  restored too (the loop itself draws nothing from them, but code it calls may: the battery draws from each);
* ``dcp.save`` with a ``FileSystemWriter(overwrite=False)`` (torch says ``overwrite`` will default to False) and a
  ``mkdir()`` without ``exist_ok`` per rank: both refuse a folder that already holds files, which the contract rules
  out (the folder ``save`` gets is empty).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler

SAMPLES, FEATURES, CLASSES, BATCH, WORKERS, TOTAL_STEPS = 120, 12, 3, 4, 2, 100


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i`` is a fixed function of ``i``: the workers need no generator of their own."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class RankSampler(Sampler[int]):
    """This rank's share of the epoch's permutation, from sample ``start`` on."""

    def __init__(self, epoch: int, rank: int, world: int, start: int) -> None:
        self.epoch, self.rank, self.world, self.start = epoch, rank, world, start

    def _mine(self) -> list[int]:
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        per_rank = SAMPLES // self.world // BATCH * BATCH  # every rank the same number of whole batches
        return order[self.rank::self.world][:per_rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._mine()[self.start:])

    def __len__(self) -> int:
        return len(self._mine()) - self.start


class LoaderTrainer:
    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.data = Points()
        self.module = nn.Sequential(nn.Linear(FEATURES, 24), nn.GELU(), nn.Linear(24, CLASSES))
        self.model = DistributedDataParallel(self.module)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, TOTAL_STEPS) / TOTAL_STEPS)))
        self.steps, self.epoch, self.batch = 0, 0, 0
        self._batches: Iterator[Any] | None = None

    def _iterator(self) -> Iterator[Any]:
        sampler = RankSampler(self.epoch, self.rank, self.world, self.batch * BATCH)
        loader = DataLoader(self.data, batch_size=BATCH, sampler=sampler, num_workers=WORKERS,
                            generator=torch.Generator().manual_seed(self.epoch))
        return iter(loader)

    def step(self) -> float:
        if self._batches is None:
            self._batches = self._iterator()
        batch = next(self._batches, None)
        if batch is None:  # the epoch is over: the next one, from its first batch
            self.epoch, self.batch = self.epoch + 1, 0
            self._batches = self._iterator()
            batch = next(self._batches)
        x, y = batch
        x = x * float(1.0 + 0.02 * np.random.standard_normal())
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.steps, self.batch = self.steps + 1, self.batch + 1
        return loss.item()

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        model, optimizer = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()},
                 storage_writer=FileSystemWriter(folder / "dcp", overwrite=False))
        own = folder / f"rank{self.rank}"
        own.mkdir()
        torch.save({"steps": self.steps, "epoch": self.epoch, "batch": self.batch, "numpy": np.random.get_state(),
                    "python": random.getstate(), "torch": torch.get_rng_state()}, own / "position.pt")

    def load(self, folder: Path) -> None:
        folder = Path(folder)
        model, optimizer = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}
        dcp.load(state, checkpoint_id=str(folder / "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        own = torch.load(folder / f"rank{self.rank}" / "position.pt", weights_only=False)  # numpy's state
        self.steps, self.epoch, self.batch = own["steps"], own["epoch"], own["batch"]
        np.random.set_state(own["numpy"])
        random.setstate(own["python"])
        torch.set_rng_state(own["torch"])
        self._batches = None  # the iterator starts at self.batch of self.epoch

    def state(self) -> dict[str, Any]:
        return {"step": self.steps, "epoch": self.epoch, "batch": self.batch, "numpy": np.random.get_state(),
                "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def close(self) -> None:
        self._batches = None  # ends the workers
        del self.model


def build() -> LoaderTrainer:
    """The factory ``--trainer`` names: called on every rank inside the process group."""
    return LoaderTrainer()
