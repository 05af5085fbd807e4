"""The global generators a resume must restore, and the deterministic settings the battery runs under.

Why the battery draws: if nothing draws from Python's or numpy's generator between seeding and a checkpoint, the state
a checkpoint saves equals a freshly seeded one, and a loop that forgets to restore it resumes onto the same numbers by
luck. So after every step the battery draws once from each global generator (as a loop's augmentation or sampling
would); a state that is not restored then differs at the end, and the comparison names it.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from harness.resume.buckets import SETTING as DDP_BUCKETS
from harness.resume.buckets import freeze_ddp_buckets

DETERMINISTIC_SETTINGS = (
    "torch.use_deterministic_algorithms(True)",
    "torch.backends.cudnn.deterministic = True",
    "torch.backends.cudnn.benchmark = False",
    "CUBLAS_WORKSPACE_CONFIG=:4096:8",
    "one intra-op thread per rank",
    DDP_BUCKETS,
)
"""What every rank of the battery runs under, named in its report: without them a CUDA kernel (or a thread count)
may change the last bits between two runs, and the comparison could not tell a resume bug from noise; and a fresh DDP
wrapper would sum its first step in another order than the run that never stopped (:mod:`harness.resume.buckets`)."""

CUBLAS_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def apply_deterministic() -> None:
    """Apply :data:`DETERMINISTIC_SETTINGS` in this rank (the launcher sets the thread count and the environment)."""
    os.environ.update(CUBLAS_ENV)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    freeze_ddp_buckets()


def seed_globals(seed: int, rank: int) -> None:
    """Each rank's global generators, seeded per ``(seed, rank)`` before the trainer is built."""
    s = seed * 1_000_003 + 7919 * (rank + 1)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)  # also seeds every CUDA device


def draw_globals() -> None:
    """One draw from each global generator: Python's, numpy's, torch's CPU one and, where CUDA is up, each device's."""
    random.random()
    np.random.random()
    torch.rand(1)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for d in range(torch.cuda.device_count()):
            torch.rand(1, device=f"cuda:{d}")


def global_states() -> dict[str, Any]:
    """The global generators' states as plain values and tensors, for a bitwise comparison."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return states


__all__ = ["CUBLAS_ENV", "DETERMINISTIC_SETTINGS", "apply_deterministic", "draw_globals", "global_states",
           "seed_globals"]
