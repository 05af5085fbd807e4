"""A recorded model call as the diagnosis reads it: a :class:`CallBatch`, its labels aligned to the positions that
predict them, and the script's model as a :class:`~harness.diagnosis.evidence.Convention` that replays the call.

The labels are read (:func:`read_labels`) in the Hugging Face convention (``labels=`` unshifted, the model shifting
them, -100 ignored), as aligned targets (``targets=`` or the second argument, nanoGPT's ``model(X, Y)``, every
negative label ignored), or by a function of the call's arguments the user names (``--labels pkg.mod:fn``).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from torch import nn

from harness.audit.options import check_labels
from harness.audit.record import Call, unreplayable
from harness.core.formats import logits_of
from harness.core.loss import loss_sum
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.model import disable_dropout

SCRIPT = "script"
"""The batch format of a script's recorded calls (:attr:`ScriptModel.batch_format`)."""


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map(v, fn) for v in value)
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class CallBatch(Microbatch):
    """A microbatch that carries the script's call: the reference replays ``call``; its rows slice every tensor
    argument whose first dimension is the batch's."""

    call: Call | None = None

    def to(self, device: torch.device | str) -> CallBatch:
        assert self.call is not None
        moved = Call(_map(self.call.args, lambda t: t.to(device)), _map(self.call.kwargs, lambda t: t.to(device)))
        return CallBatch(self.inputs.to(device), self.labels.to(device), call=moved)

    def row(self, i: int) -> CallBatch:
        assert self.call is not None
        rows = self.inputs.shape[0]

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[i : i + 1] if t.dim() and t.shape[0] == rows else t

        return CallBatch(self.inputs[i : i + 1], self.labels[i : i + 1],
                         call=Call(_map(self.call.args, cut), _map(self.call.kwargs, cut)))


@dataclass(frozen=True)
class ScriptModel:
    """The script's own model as the diagnosis's :class:`~harness.diagnosis.evidence.Convention`: a copy of it on
    the CPU, dropout off, in train mode, called as the script called it; the loss sum of the aligned labels."""

    template: nn.Module
    buffers: tuple[torch.Tensor, ...] = ()
    """The script's model's buffers when the first window started (a template built on the meta device has none)."""
    path: str | None = None
    batch_format: str = SCRIPT
    """Not one of the battery's formats: the script's own call, which only a recorded call replays (a reading that
    builds batches of its own, the prompt family's, leaves such evidence alone)."""

    def build(self) -> nn.Module:
        model = copy.deepcopy(self.template)
        meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
        model = model.to_empty(device="cpu") if meta else model.to("cpu")
        own = list(model.buffers())
        if len(own) == len(self.buffers):
            with torch.no_grad():
                for mine, theirs in zip(own, self.buffers):
                    if mine.shape == theirs.shape:
                        mine.copy_(theirs)
        model = disable_dropout(model)
        model.train()
        return model

    def logits(self, model: nn.Module, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(mb, CallBatch) and mb.call is not None:
            dtype = next(model.parameters()).dtype
            args, kwargs = (_map(part, lambda t: t.to(dtype) if t.is_floating_point() else t)
                            for part in (mb.call.args, mb.call.kwargs))
            raw = logits_of(model(*args, **kwargs))
        else:
            raw = logits_of(model(input_ids=mb.inputs))
        return raw, raw

    def loss_sum(self, model: nn.Module, mb: Microbatch) -> torch.Tensor:
        return loss_sum(self.logits(model, mb)[1], mb.labels)

    def reference_batch(self, mb: Microbatch) -> object:
        return mb


def _int_tensor(value: Any) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()


def read_labels(call: Call, labels: str = "auto") -> tuple[torch.Tensor, str]:
    """The call's labels aligned to the positions that predict them (``IGNORE_INDEX`` where none), and the words for
    where they were read. ``labels``: :data:`LABELS_HELP`. ValueError naming what is missing."""
    args, kwargs = call.args, call.kwargs
    if check_labels(labels) == "auto":
        if "labels" in kwargs:
            labels = "hf"
        elif "targets" in kwargs or (len(args) > 1 and _int_tensor(args[1]) and _int_tensor(args[0])
                                     and args[1].shape == args[0].shape):
            labels = "aligned"
    if labels == "hf":
        raw = kwargs.get("labels")
        if not _int_tensor(raw) or raw.dim() != 2:
            msg = ("the model was called without a labels= tensor [B, T]: the audit reads the labels the model is "
                   "given (a Hugging Face causal LM's labels=...); name them with --labels")
            raise ValueError(msg)
        aligned = torch.full_like(raw.long(), IGNORE_INDEX)
        aligned[:, :-1] = raw[:, 1:].long()
        return aligned, "labels= in the Hugging Face convention (unshifted, the model shifts them, -100 ignored)"
    if labels == "aligned":
        raw = kwargs.get("targets", kwargs.get("labels", args[1] if len(args) > 1 else None))
        if not _int_tensor(raw) or raw.dim() != 2:
            msg = ("no aligned targets found: --labels aligned reads a targets= (or labels=) keyword or the model's "
                   "second argument, an integer tensor [B, T]")
            raise ValueError(msg)
        return raw.long().masked_fill(raw < 0, IGNORE_INDEX), ("the targets the model is given, aligned (negative "
                                                               "ignored)")
    if ":" in labels:
        raw = imported(labels, "--labels", "a function of (args, kwargs)")(args, kwargs)
        if not _int_tensor(raw) or raw.dim() != 2:
            msg = f"--labels {labels} returned {type(raw).__name__}; it must return the aligned labels, an int [B, T]"
            raise ValueError(msg)
        return raw.long().masked_fill(raw < 0, IGNORE_INDEX), f"the labels {labels} returns (negative ignored)"
    if labels == "auto":
        msg = ("the model was called without labels (no labels= or targets= keyword, no second argument of the input "
               "ids' shape): the audit reads the labels the model is given; a loop whose loss is outside the model "
               "names them with --labels PKG.MODULE:FN")
        raise ValueError(msg)
    msg = f"--labels {labels!r}: give auto, hf, aligned or PKG.MODULE:FN"  # pragma: no cover (check_labels)
    raise ValueError(msg)


def imported(spec: str, option: str, what: str) -> Any:
    """``PKG.MODULE:ATTR``'s object. ValueError naming ``option``, the value and what it must be."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        msg = f"{option} {spec}: cannot import it ({exc}); give PKG.MODULE:ATTR, {what}"
        raise ValueError(msg) from None


def model_from(spec: str) -> nn.Module:
    """``--model PKG.MODULE:FACTORY``'s model: the factory called with no argument (an nn.Module class is one)."""
    model = imported(spec, "--model", "a zero-argument callable returning the script's model")()
    if not isinstance(model, nn.Module):
        msg = f"--model {spec} returned {type(model).__name__}, not a torch.nn.Module"
        raise ValueError(msg)
    return model


def microbatch(call: Call, labels: str = "auto") -> CallBatch:
    """A call as a :class:`CallBatch`. ValueError naming what the audit cannot read."""
    aligned, _ = read_labels(call, labels)
    found = unreplayable((call.args, call.kwargs))
    if found is not None:
        msg = (f"the model was called with a {found} argument, which the audit does not record: its reference cannot "
               "replay the call")
        raise ValueError(msg)
    ids = call.kwargs.get("input_ids", call.args[0] if call.args else None)
    inputs = ids.long() if _int_tensor(ids) and ids.shape == aligned.shape else torch.zeros_like(aligned)
    return CallBatch(inputs, aligned, call=call)


__all__ = ["SCRIPT", "CallBatch", "ScriptModel", "imported", "microbatch", "model_from", "read_labels"]
