"""Leak checks after every test, in the spirit of Hypothesis's own conftest: a test may not leave a process group
initialized in the pytest process, a child process alive, or the global RNG state changed."""

from __future__ import annotations

import multiprocessing
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

# Recipes written as users write them (tests/user_recipes) are imported by ranks as ``user_recipes.<module>``: the
# folder must be on sys.path before the launcher's forkserver starts, which copies sys.path once.
_TESTS = str(Path(__file__).parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    torch_state = torch.get_rng_state()
    py_state = random.getstate()
    np_state = np.random.get_state()
    yield
    problems = []
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        problems.append("a process group was left initialized in the pytest process")
    alive = multiprocessing.active_children()
    if alive:
        for p in alive:
            p.kill()
        problems.append(f"child processes outlived the test: {[p.name for p in alive]}")
    if not torch.equal(torch_state, torch.get_rng_state()):
        torch.set_rng_state(torch_state)
        problems.append("the global torch RNG state changed")
    if random.getstate() != py_state:
        random.setstate(py_state)
        problems.append("the global random RNG state changed")
    new_np = np.random.get_state()
    if not all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(np_state, new_np)):
        np.random.set_state(np_state)
        problems.append("the global numpy RNG state changed")
    if problems:
        pytest.fail("; ".join(problems))

