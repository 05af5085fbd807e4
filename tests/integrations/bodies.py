"""Rank bodies for the integrations lane, imported by ranks as ``integrations.bodies`` (the tests put ``tests/`` on
``sys.path``, which each rank inherits)."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from harness.battery.scenarios import BATTERY_CONFIG
from harness.model import build_model


def prepare_wrapped_model() -> list[str]:
    """A model the caller already wrapped in DDP, handed to ``Accelerator(cpu=True).prepare`` as the accelerate
    guide hands a plain one: returns the chain of wrapper class names ``prepare`` gives back."""
    import accelerate

    model = DDP(build_model(BATTERY_CONFIG))
    prepared = accelerate.Accelerator(cpu=True).prepare(model)
    chain, inner = [], prepared
    while True:
        chain.append(type(inner).__name__)
        if not hasattr(inner, "module"):
            return chain
        inner = inner.module
