"""The strategy seam (:mod:`harness.distributed.strategies`): one module per strategy, each registered by itself, and
nothing above the seam building a DDP of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness.distributed import strategies

HARNESS = Path(__file__).parents[2] / "harness"
SEAM = HARNESS / "distributed" / "strategies"


def test_every_strategy_module_registers_its_strategy_under_its_module_name() -> None:
    """A module under strategies/ (but the protocol's) is one strategy, registered under the module's name."""
    modules = {p.stem for p in SEAM.glob("*.py")} - {"__init__", "base"}
    assert modules == set(strategies.STRATEGIES)


def test_an_unknown_strategy_is_refused_naming_the_known_ones() -> None:
    """get() says which names exist."""
    with pytest.raises(ValueError, match="strategy='fsdp9' must be one of ddp"):
        strategies.get("fsdp9")


def test_a_strategy_is_registered_once() -> None:
    """A second strategy under a taken name is an error, not a silent replacement."""
    with pytest.raises(ValueError, match="registered twice"):
        strategies.register(strategies.get("ddp"))


def _builds_ddp(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("DDP", "DistributedDataParallel"):
                return True
    return False


def test_ddp_is_built_in_exactly_one_place_of_the_product() -> None:
    """Only strategies/ddp.py constructs a DistributedDataParallel inside the package (the one-layer DDPs of the
    symmetry bodies and the DDP probe are test code, in tests/support/)."""
    builders = sorted(str(p.relative_to(HARNESS)) for p in HARNESS.rglob("*.py") if _builds_ddp(p.read_text()))
    assert ["distributed/strategies/ddp.py"] == builders


def test_the_ddp_check_sees_a_construction() -> None:
    """Its negative control: a module that calls DDP(...) is found."""
    assert _builds_ddp("from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(model)\n")
    assert not _builds_ddp("from torch.nn.parallel import DistributedDataParallel as DDP\n")
