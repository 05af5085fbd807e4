"""What an audit recorded, as plain data: each audited window's starting weights, its model calls' arguments, the
clip the loop applied and the gradient at ``optimizer.step()`` (:class:`Window`), and the run around them
(:class:`Record`). :mod:`harness.audit.watcher` fills it; :mod:`harness.audit.evidence` reads it;
:mod:`harness.audit.capture` carries it between ranks as :func:`plain` data."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn


@dataclass
class Call:
    """One outermost model call: its positional and keyword arguments as the script passed them, every tensor
    detached and copied to the CPU (:func:`plain`)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return _nbytes((self.args, self.kwargs))


@dataclass
class Clip:
    """A ``clip_grad_norm_`` call of the window: its ``max_norm``, ``norm_type`` and the total norm it returned."""

    max_norm: float
    norm_type: float
    returned: float


@dataclass
class Window:
    """One audited window: the weights when it started, its calls, the clip (if any) and the gradient at
    ``optimizer.step()``."""

    start: torch.Tensor
    calls: list[Call] = field(default_factory=list)
    grad: torch.Tensor | None = None
    syncs: int | None = None
    """The calls whose backward DDP synchronizes (its ``require_backward_grad_sync`` set, gradients on, as DDP reads
    them at each forward); None when the model is not wrapped by DDP."""
    clips: list[Clip] = field(default_factory=list)
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    """The random generators' states when the window started (``cpu``; ``cuda`` where CUDA is initialized)."""
    autocast: str | None = None
    """The autocast dtype the window's calls ran under (``"bfloat16"``, ``"float16"``); None: none."""
    buffers: list[torch.Tensor] = field(default_factory=list)
    """The model's buffers when the window started, in ``buffers()`` order (rotary tables, normalization statistics)."""


class Record:
    """An audit's record: ``wanted`` windows after ``skip`` optimizer steps; the model (the outermost module called),
    the windows recorded, the optimizer steps seen, what could not be read (``problems``), what the audit did to the
    run and says in its report (``notes``), and a reason the capture stopped (``refusal``)."""

    def __init__(self, windows: int, skip: int) -> None:
        if windows < 1:
            msg = f"windows={windows} must be at least 1: the number of optimizer steps to audit"
            raise ValueError(msg)
        if skip < 0:
            msg = f"skip={skip} must be 0 or more: the optimizer steps to let pass before the audited windows"
            raise ValueError(msg)
        self.wanted, self.skip = windows, skip
        self.model: nn.Module | None = None
        self.windows: list[Window] = []
        self.steps = 0
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.refusal: str | None = None
        self.strategy: str | None = None
        """How the model is wrapped: ``"ddp"``, ``"fsdp2"``, or None (neither)."""

    def to_plain(self) -> dict[str, Any]:
        """The record without its model, as plain data (tensors, numbers, strings, lists, dicts)."""
        return {"steps": self.steps, "problems": self.problems, "notes": self.notes, "refusal": self.refusal,
                "skip": self.skip, "wanted": self.wanted,
                "windows": [{**{f.name: getattr(w, f.name) for f in fields(w)},  # no copy of the tensors
                             "calls": [{"args": list(c.args), "kwargs": c.kwargs} for c in w.calls]}
                            for w in self.windows]}

    @classmethod
    def from_plain(cls, data: dict[str, Any]) -> Record:
        record = cls(data["wanted"], data["skip"])
        record.steps, record.refusal = data["steps"], data["refusal"]
        record.problems, record.notes = list(data["problems"]), list(data["notes"])
        record.windows = [Window(w["start"], [Call(tuple(c["args"]), dict(c["kwargs"])) for c in w["calls"]],
                                 w["grad"], w["syncs"], [Clip(**vars(c)) if isinstance(c, Clip) else Clip(**c)
                                                         for c in w["clips"]], dict(w["rng"]),
                                 w["autocast"], list(w["buffers"]))
                          for w in data["windows"]]
        return record


def plain(value: Any) -> Any:
    """``value`` as plain data: tensors detached and copied to the CPU (a DTensor gathered whole), tuples, lists and
    dicts element by element, numbers, strings and None as they are; anything else as the string ``<TypeName>``
    (a reference call that needs it is named as not replayable)."""
    if isinstance(value, torch.Tensor):
        full = getattr(value, "full_tensor", None)
        return (full() if callable(full) else value).detach().cpu().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(plain(v) for v in value) if type(value) in (tuple, list) else [plain(v) for v in value]
    if isinstance(value, dict) or (hasattr(value, "keys") and hasattr(value, "__getitem__")):
        keys = list(value.keys())  # a Mapping, or a mapping-like batch (transformers' BatchEncoding)
        return {str(k): plain(value[k]) for k in keys}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"<{type(value).__name__}>"


def unreplayable(value: Any) -> str | None:
    """The first ``<TypeName>`` placeholder :func:`plain` left in ``value`` (None: every part was recorded)."""
    if isinstance(value, str) and value.startswith("<") and value.endswith(">"):
        return value[1:-1]
    parts = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for part in parts:
        found = unreplayable(part)
        if found is not None:
            return found
    return None


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    parts = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return sum(_nbytes(p) for p in parts)


__all__ = ["Call", "Clip", "Record", "Window", "plain", "unreplayable"]
