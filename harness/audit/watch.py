"""Watching a training loop the harness did not write: the in-code form of the audit, in one process.

    with harness.audit.watch(windows=1) as audit:
        train()                      # the script's own loop, unchanged
    print(audit.verdict())          # parity against the single-device reference, the reading and its fix

While the block runs, two global hooks of torch watch every model and optimizer in the process
(``register_module_forward_hook(..., with_kwargs=True)`` with its pre-hook, and
``register_optimizer_step_pre_hook``): the outermost module call (through DDP: its ``module``) is the model; after
``skip`` optimizer steps, each of the next ``windows`` windows records the model's weights when its first call
starts, every call's batch (``input_ids``, ``labels``, ``attention_mask``, by keyword or as the first argument), how
many of the calls DDP synchronizes (its ``require_backward_grad_sync`` at each forward, which ``no_sync()`` clears),
and, when ``optimizer.step()`` begins, the gradient each parameter holds. Nothing is recorded after the last window, and
the hooks are removed when the block ends. :mod:`harness.audit.evidence` turns the record into the diagnosis's
:class:`~harness.diagnosis.evidence.Evidence`.

A model that is not given its labels, a loop that never steps an optimizer, and a window whose weights change
between calls (an optimizer stepped by hand) are named by :meth:`Audit.verdict`, never judged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from harness.audit.record import Call, Record, Window
from harness.core.compare import flat_grad, flat_params


def _unwrap(module: nn.Module) -> nn.Module:
    inner = getattr(module, "module", None)
    return inner if isinstance(inner, nn.Module) and type(module).__name__ == "DistributedDataParallel" else module


def _tensor(value: Any) -> torch.Tensor | None:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else None


class Audit(Record):
    """What :func:`watch` records (a :class:`~harness.audit.record.Record`); :meth:`verdict` judges it."""

    def __init__(self, windows: int, skip: int) -> None:
        super().__init__(windows, skip)
        self._depth = 0
        self._open: Window | None = None

    @property
    def recording(self) -> bool:
        return self.skip <= self.steps < self.skip + self.wanted

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0 and self.recording:
            model = _unwrap(module)
            if self.model is None:
                self.model = model
            if model is self.model and self._open is None:
                self._open = Window(flat_params(model).detach().clone())
            if model is self.model and model is not module:  # DDP: this call's backward synchronizes or not
                synced = torch.is_grad_enabled() and bool(getattr(module, "require_backward_grad_sync", True))
                assert self._open is not None
                self._open.syncs = (self._open.syncs or 0) + int(synced)
        self._depth += 1

    def _post(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        self._depth -= 1
        if self._depth != 0 or self._open is None or _unwrap(module) is not self.model:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            self.problems.append(f"the model {type(self.model).__name__} was called without input_ids (by keyword or "
                                 "as its first argument): the audit reads a causal LM's batch")
            return
        self._open.calls.append(Call(_tensor(ids), _tensor(kwargs.get("labels")),  # type: ignore[arg-type]
                                     _tensor(kwargs.get("attention_mask"))))

    def _step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.recording and self._open is not None and self.model is not None:
            self._open.grad = flat_grad(self.model).clone()
            self.windows.append(self._open)
        self._open = None
        self.steps += 1

    def verdict(self) -> Any:
        """The audit's verdict (:class:`harness.audit.evidence.AuditVerdict`)."""
        from harness.audit.evidence import judge

        return judge(self)


@contextlib.contextmanager
def watch(windows: int = 1, skip: int = 0) -> Iterator[Audit]:
    """Record ``windows`` optimizer steps of whatever loop runs inside the block, after ``skip`` steps."""
    audit = Audit(windows, skip)
    handles = [register_module_forward_pre_hook(audit._pre),
               register_module_forward_hook(audit._post, with_kwargs=True),
               register_optimizer_step_pre_hook(audit._step)]
    try:
        yield audit
    finally:
        for h in handles:
            h.remove()


__all__ = ["Audit", "watch"]
