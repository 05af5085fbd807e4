"""Rank bodies and loops for the resume battery's tests: a model re-wrapped in a fresh DDP at one step of a run (the
reduction order a resume changes), and loops that refuse or crash where a real loop would."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from harness.resume.buckets import freeze_ddp_buckets, thaw_ddp_buckets
from harness.training.trainer import HarnessTrainer, trainer_factory


def _train(rewrap_at: int | None, options: dict[str, Any], steps: int = 20) -> list[torch.Tensor]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    data = torch.Generator().manual_seed(100 + rank)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    model = DistributedDataParallel(module, **options)
    for step in range(1, steps + 1):
        if step == rewrap_at:
            del model
            model = DistributedDataParallel(module, **options)  # what a resumed run does: a fresh wrapper
        x, y = torch.randn(8, 16, generator=data), torch.randint(0, 4, (8,), generator=data)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model
    return [p.detach().clone() for p in module.parameters()]


def rewrap_gap(frozen: bool, options: dict[str, Any] | None = None) -> float:
    """Largest difference between a run that keeps one DDP wrapper and one re-wrapped at step 13 of 20, with DDP's
    buckets frozen in their construction layout (``frozen``) or rebuilt as DDP does by default; ``options`` are
    DDP's keywords (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``)."""
    if frozen:
        freeze_ddp_buckets()
    try:
        kept, rewrapped = _train(None, options or {}), _train(13, options or {})
    finally:
        thaw_ddp_buckets()
    return max(float((a - b).abs().max()) for a, b in zip(kept, rewrapped))


def refuses_three_ranks() -> HarnessTrainer:
    """The harness's trainer on its config file as it is: it refuses any world size but the file's 2."""
    from pathlib import Path

    return trainer_factory(Path(__file__).resolve().parents[2] / "configs" / "minimum.yaml")


class _OutsideTheContract:
    def __init__(self) -> None:
        self.inner = trainer_factory()

    def step(self) -> float:
        return self.inner.step()

    def save(self, folder: Any) -> None:
        self.inner.save(folder)

    def load(self, folder: Any) -> None:
        self.inner.load(folder)

    def state(self) -> dict[str, Any]:
        return {**self.inner.state(), "sampler": object()}  # the mistake: an object the battery cannot compare

    def close(self) -> None:
        self.inner.close()


def object_in_state() -> _OutsideTheContract:
    """The harness's trainer with an object in its state()."""
    return _OutsideTheContract()


class _CrashesAfterAResume(_OutsideTheContract):
    def __init__(self) -> None:
        super().__init__()
        self.resumed = False

    def load(self, folder: Any) -> None:
        super().load(folder)
        self.resumed = True

    def save(self, folder: Any) -> None:
        if self.resumed:
            msg = "[Errno 28] No space left on device"
            raise OSError(msg)
        super().save(folder)

    def state(self) -> dict[str, Any]:
        return self.inner.state()


def crashes_after_a_resume() -> _CrashesAfterAResume:
    """The harness's trainer whose saves raise once it has resumed: every resumed leg crashes."""
    return _CrashesAfterAResume()
