"""What a rank watches around one call of a recipe: the global generators (and who moved them:
:mod:`harness.battery.rank.rng_watch`) and settings it moved, the gradients and weights it left, and whether the model's
forward ran under autocast. The rank program
(:mod:`harness.battery.rank.rank_program`) reads these before and after each window; each becomes a field of its
:class:`~harness.battery.launch.run.WindowRecord`.
"""

from __future__ import annotations

import os
import sys

import torch

from harness.battery.rank.rng_watch import same, states
from harness.distributed.strategies.fsdp2 import local


def as_float(value: object) -> float:
    """A returned norm as a float: a tensor, or FSDP2's replicated DTensor (its local value is the whole norm)."""
    local = getattr(value, "to_local", None)
    return float(local() if local is not None else value)  # type: ignore[arg-type]


def rng_states() -> dict[str, object]:
    """Every global generator's state (CUDA's where initialized); :mod:`harness.battery.rank.rng_watch` tells who moved
    one."""
    return states()


def moved(before: dict[str, object], after: dict[str, object]) -> tuple[str, ...]:
    return tuple(name for name in after if name not in before or not same(before[name], after[name]))


def settings_notes(threads: int, env: dict[str, str]) -> tuple[str, ...]:
    notes = []
    if torch.get_num_threads() != threads:
        notes.append(f"intra-op threads {threads} -> {torch.get_num_threads()}")
    changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
    if changed:
        notes.append("environment variables changed: " + ", ".join(changed))
    return tuple(notes)


def grads_left(model: torch.nn.Module) -> str:
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    if not grads:
        return "none"
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        return "nonfinite"
    return "nonzero" if any(bool(g.any()) for g in grads) else "zero"


def changed_tensors(before: list[torch.Tensor], model: torch.nn.Module) -> tuple[str, ...]:
    return tuple(n for (n, p), b in zip(model.named_parameters(), before) if not torch.equal(local(p.detach()), b))


class AutocastSeen:
    """A forward pre-hook that records whether the model's forward runs under autocast, and in which dtype."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.seen: str | None = None

    def __call__(self, module: torch.nn.Module, args: object) -> None:
        if self.seen is None and autocast_enabled(self.device_type):
            where = _caller()
            self.seen = (f"{self.device_type} {autocast_dtype(self.device_type)}"
                         f"{f', entered around the model call at {where}' if where else ''}")


def _caller() -> str | None:
    """``file:line in function`` of the first frame outside torch and the harness: the code that called the model
    (the recipe), where an autocast seen at the model's forward was entered."""
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not module.startswith(("torch", "harness.", "contextlib")):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def autocast_enabled(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch before 2.4: no device argument
        return bool(torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled())


def autocast_dtype(device_type: str) -> torch.dtype:
    try:
        return torch.get_autocast_dtype(device_type)
    except (AttributeError, TypeError):
        return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()
