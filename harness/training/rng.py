"""Each rank's random generators: seeded per ``(seed, rank)``, saved into and restored from its rank file.

Dropout draws from the rank's own torch stream, so ranks draw different masks; a resume must restore each rank's own
Python, numpy, torch CPU and CUDA states, never rank 0's on every rank.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rank_seed(seed: int, rank: int) -> int:
    """Each rank's own stream: different per rank (dropout masks differ), reproducible per (seed, rank)."""
    return (seed * 1_000_003 + 7919 * (rank + 1)) % (2**63)


def seed_rngs(seed: int, rank: int) -> None:
    s = rank_seed(seed, rank)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)  # also seeds every CUDA device


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's generator states, as tensors and plain Python (loadable with ``weights_only=True``)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


__all__ = ["rank_seed", "rng_state", "seed_rngs", "set_rng_state"]
