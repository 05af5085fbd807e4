"""A plain PyTorch data-parallel loop with everything a resume must restore, and nothing from the harness.

``--trainer=harness.resume.examples.plain:build``. What it holds, and why each piece matters to a resume:

* a small MLP classifier under ``DistributedDataParallel``, with dropout drawn from torch's global generator;
* SGD with momentum (a buffer per parameter) and a warm-up-then-decay ``LambdaLR`` (its position is state);
* a ``DistributedSampler`` with ``set_epoch``: the data position is the epoch and the batch within it, and a resume
  fast-forwards to it rather than starting the epoch again;
* augmentation noise from a ``torch.Generator`` the loop owns, and a token drop decided by Python's ``random`` and a
  jitter by numpy's global generator, so those states matter too;
* ``torch.save`` / ``torch.load``: the model, optimizer and scheduler from rank 0, one file per rank with its data
  position and every generator state (each rank's dropout stream is its own).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

SAMPLES, FEATURES, CLASSES, BATCH, TOTAL_STEPS = 96, 16, 4, 8, 100


def make_dataset(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return TensorDataset(x, y)


def lr_factor(step: int, warmup: int = 5, total: int = TOTAL_STEPS) -> float:
    return (step + 1) / warmup if step < warmup else max(0.0, (total - step) / (total - warmup))


class PlainTrainer:
    def __init__(self, seed: int = 0) -> None:
        self.rank = dist.get_rank()
        self.data = make_dataset(seed)
        self.sampler: DistributedSampler[Any] = DistributedSampler(self.data, shuffle=True, seed=seed)
        self.module = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, CLASSES))
        self.model = DistributedDataParallel(self.module)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)
        self.noise = torch.Generator().manual_seed(1000 + self.rank)  # this rank's augmentation stream
        self.steps, self.epoch, self.batch = 0, 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        self.sampler.set_epoch(self.epoch)  # without it every epoch repeats the first one's order
        return list(self.sampler)

    def step(self) -> float:
        if (self.batch + 1) * BATCH > len(self._order):
            self.epoch, self.batch = self.epoch + 1, 0
            self._order = self._epoch_order()
        ids = self._order[self.batch * BATCH:(self.batch + 1) * BATCH]
        x, y = self.data.tensors[0][ids], self.data.tensors[1][ids]
        x = x + 0.05 * torch.randn(x.shape, generator=self.noise)
        x = x * float(1.0 + 0.01 * np.random.standard_normal())  # numpy's global generator
        if random.random() < 0.25:  # Python's global generator: drop one feature column
            x[:, random.randrange(FEATURES)] = 0.0
        self.model.train()
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.steps, self.batch = self.steps + 1, self.batch + 1
        return float(loss)

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        if self.rank == 0:
            torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict()}, folder / "model.pt")
        torch.save(self.rank_state(), folder / f"rank{self.rank}.pt")

    def rank_state(self) -> dict[str, Any]:
        """What differs per rank: the data position and every generator's state (numpy's as a tensor, so that
        ``torch.load(weights_only=True)`` reads it back)."""
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        return {
            "steps": self.steps, "epoch": self.epoch, "batch": self.batch, "python": random.getstate(),
            "numpy": (name, torch.from_numpy(np.array(keys)), pos, has_gauss, cached),
            "torch": torch.get_rng_state(), "noise": self.noise.get_state(),
        }

    def load(self, folder: Path) -> None:
        folder = Path(folder)
        shared = torch.load(folder / "model.pt", weights_only=True)
        own = torch.load(folder / f"rank{self.rank}.pt", weights_only=True)
        self.module.load_state_dict(shared["model"])
        self.optimizer.load_state_dict(shared["optimizer"])
        self.scheduler.load_state_dict(shared["scheduler"])
        self.restore_rank_state(own)

    def restore_rank_state(self, own: dict[str, Any]) -> None:
        self.steps, self.epoch, self.batch = own["steps"], own["epoch"], own["batch"]
        self._order = self._epoch_order()  # the same epoch's order; self.batch fast-forwards into it
        version, internal, gauss = own["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = own["numpy"]
        np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
        torch.set_rng_state(own["torch"])
        self.noise.set_state(own["noise"])

    def state(self) -> dict[str, Any]:
        return {
            "step": self.steps, "epoch": self.epoch, "batch": self.batch,
            "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "noise": self.noise.get_state(),
        }

    def close(self) -> None:
        del self.model  # before the process group goes away: a live DDP module can hang the rank's exit


def build() -> PlainTrainer:
    """The factory ``--trainer`` names: called on every rank inside the process group."""
    return PlainTrainer()
