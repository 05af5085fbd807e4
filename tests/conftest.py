"""Leak checks after every test, in the spirit of Hypothesis's own conftest: a test may not leave a process group
initialized in the pytest process, a child process alive, or the global RNG state changed."""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

# Recipes written as users write them (tests/user_recipes) are imported by ranks as ``user_recipes.<module>``, and the
# test-only rank bodies and helpers (tests/support) as ``support.<module>``: the folder must be on sys.path before the
# launcher's forkserver starts, which copies sys.path once.
_TESTS = str(Path(__file__).parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def _warm_forkserver() -> None:
    """Every module of tests/user_recipes and tests/support is imported by the forkserver when it first starts, in
    each xdist worker: otherwise each new module a test launches restarts the server cold (seconds each)."""
    from harness.distributed.launcher import warm

    names = [f"{pkg}.{p.stem}" for pkg in ("user_recipes", "support")
             for p in sorted(Path(_TESTS, pkg).glob("*.py")) if p.stem != "__init__"]
    # The product's recipe modules the tests launch beside harness.recipes itself (the objectives' recipes).
    warm(*names, "harness.recipes.objectives")


_warm_forkserver()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: each computes on one thread. With torch's default (one thread per core) a worker's
    # intra-op threads spin against the other worker's ranks, and a 5 ms fit in tests/unit took seconds.
    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The shipped battery's cases at W=4 (the most expensive launches) and on ``token_budget`` (the scenario of
    re-split micro-batches, whose recipes' tests are tests/distributed/test_dynamic_microbatches.py) run in this
    repository's slow tier: the test command keeps W=1, 2 and 3 of every check and of the other scenarios, and CI runs
    the slow tier too. Users' own sessions (``pytest --pyargs harness.battery``) are not affected: this conftest is
    the repository's."""
    for item in items:
        case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
        if item.nodeid.startswith("harness/battery/test_battery.py") and (
                getattr(case, "world_size", None) == 4 or getattr(case, "scenario", None) == "token_budget"):
            item.add_marker(pytest.mark.slow)


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

