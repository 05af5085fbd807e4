"""The model a battery run checks and its batch convention, as one small picklable value that travels to every rank.

:class:`ModelSpec` builds the same model with the same initial weights wherever it is asked (each rank, the parent's
reference, the logged-loss check, the diagnosis), hands the recipe its microbatches in the run's batch format, and
computes a microbatch's loss sum under that format. Without ``--model`` it is the harness's built-in
``TinyCausalLM`` at the battery's size and every number is the one the battery computed before ``--model`` existed.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from harness.battery import scenarios
from harness.battery.launch import printed
from harness.battery.plan.options import RunSpec
from harness.core.compare import PRECISIONS as COMPUTE_DTYPES
from harness.core.compare import flat_params
from harness.core.formats import (
    HARNESS,
    HF,
    PACKED,
    batch_as,
    check_batch_format,
    logits_of,
    shifted_loss_sum,
    to_hf,
)
from harness.core.loss import loss_sum
from harness.core.microbatch import Microbatch
from harness.model import build_model, build_user_model, disable_dropout, load_model_factory

PRECISIONS = {**COMPUTE_DTYPES, "bf16": torch.float32}
"""The dtype a model is built in for each battery lane: the bf16 lane keeps float32 weights (autocast, or FSDP2's
policy, computes in bf16)."""

_BUILT: dict[tuple[object, ...], nn.Module] = {}
"""Models this process has built, by (path, seed, precision): :meth:`ModelSpec.build` hands out copies."""


@dataclass(frozen=True)
class ModelSpec:
    """``path`` (``"pkg.mod:factory"``, None: the built-in model), the batch format, the initial weights' seed (None:
    the battery config's) and the precision; ``digest``, when set, is the initial weights' fingerprint every rank
    must reproduce."""

    path: str | None = None
    batch_format: str = HARNESS
    init_seed: int | None = None
    precision: str = "fp32"
    digest: str | None = None

    def __post_init__(self) -> None:
        check_batch_format(self.batch_format)
        if self.precision not in PRECISIONS:
            msg = f"precision={self.precision!r} must be one of {sorted(PRECISIONS)}"
            raise ValueError(msg)

    @classmethod
    def of(cls, run: RunSpec, digest: str | None = None) -> ModelSpec:
        """The model of a battery run (its path, batch format, seed and precision), with the initial weights'
        fingerprint ``digest`` when the ranks must reproduce it."""
        return cls(run.model, run.batch_format, run.init_seed, run.precision, digest)

    @property
    def seed(self) -> int:
        return scenarios.BATTERY_CONFIG.seed if self.init_seed is None else self.init_seed

    def build(self) -> nn.Module:
        """A fresh single-device model: the initial weights of ``seed``, the precision's dtype, dropout disabled
        (:func:`harness.model.disable_dropout`), train mode."""
        key = (self.path, self.seed, self.precision)
        template = _BUILT.get(key)
        if template is not None:
            with contextlib.suppress(Exception):  # a model deepcopy cannot copy is built again below
                return copy.deepcopy(template)
        if self.path is None:
            model: nn.Module = build_model(scenarios.BATTERY_CONFIG, seed=self.init_seed)
        else:
            with printed.building():  # a constructor's print, said once at the end of the battery
                model = build_user_model(self.path, self.seed)
        model = disable_dropout(model.to(PRECISIONS[self.precision]))
        model.train()
        if len(_BUILT) < 8:
            # One process builds the same model for the reference chain, the logged-loss truth and the diagnosis of
            # every case: a copy of the first costs a fraction of calling a library's constructor again.
            with contextlib.suppress(Exception):
                _BUILT[key] = copy.deepcopy(model)
        return model

    def check_weights(self, model: nn.Module, where: str) -> None:
        """RuntimeError unless ``model``'s initial weights are the ones ``digest`` fingerprints (nothing to check
        without a digest)."""
        if self.digest is not None and weights_digest(model) != self.digest:
            msg = (f"model={self.path!r}: {where} built other initial weights than the reference; the factory must "
                   "draw its weights from torch's global generator (the harness seeds it right before the call) or "
                   "build them deterministically")
            raise RuntimeError(msg)

    def batch(self, mb: Microbatch) -> Microbatch | dict[str, object]:
        """What the recipe receives for ``mb``."""
        return batch_as(mb, self.batch_format)

    def reference_batch(self, mb: Microbatch) -> Microbatch | dict[str, torch.Tensor]:
        """``mb`` as the reference forwards it (:meth:`logits`): packed rows are judged against the same sequences
        unpacked, so under ``packed`` it is the hf dict, not the packed one."""
        return to_hf(mb) if self.batch_format in (HF, PACKED) else mb

    @property
    def unpacked(self) -> bool:
        """Whether the reference calls the model the hf way: under ``hf``, and under ``packed``, whose reference is
        the same sequences *unpacked* (one padded row each, with its attention mask), so that the recipe's packed
        batches pass parity only if the packing (and the model's handling of it) is exact."""
        return self.batch_format in (HF, PACKED)

    def loss_sum(self, model: nn.Module, mb: Microbatch) -> torch.Tensor:
        """The loss *sum* of ``mb`` under this convention: ``model(inputs)`` against the aligned labels, or (``hf``,
        and ``packed`` unpacked: :attr:`unpacked`) the hf call ``model(input_ids=..., attention_mask=...)`` against
        the unshifted labels with the shift in the loss."""
        if self.unpacked:
            batch = to_hf(mb)
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            return shifted_loss_sum(logits_of(out), batch["labels"])
        if self.path is None:
            return loss_sum(model(mb.inputs), mb.labels)
        return loss_sum(logits_of(model(mb.inputs)), mb.labels)

    def logits(self, model: nn.Module, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(what the model returned as logits, the logits aligned with mb.labels)``: the same under the harness
        convention; under hf (and packed, unpacked) the returned ``[B, T+1, V]`` and its first T positions (position t
        predicts the token at t + 1, which is ``mb.labels[:, t]``)."""
        if self.unpacked:
            batch = to_hf(mb)
            raw = logits_of(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
            return raw, raw[:, :-1]
        raw = logits_of(model(mb.inputs))
        return raw, raw


def weights_digest(model: nn.Module) -> str:
    """A fingerprint of the weights (bitwise): equal digests, equal initial weights."""
    return hashlib.sha256(flat_params(model).detach().cpu().numpy().tobytes()).hexdigest()


def model_module(path: str | None) -> str | None:
    """The module a ``--model`` factory lives in (for the launcher to preload), else None."""
    if path is None:
        return None
    load_model_factory(path)  # a bad path fails here, naming the fix, not in every rank
    return path.split(":")[0]


@lru_cache(maxsize=16)
def model_modules(path: str | None) -> tuple[str, ...]:
    """Every module the classes of ``--model``'s built model come from (its factory's, each submodule's, its config's),
    for the launcher to preload: a factory that imports transformers inside its body would otherwise make every rank
    of every launch import it (seconds per launch), since importing the factory's own module does not."""
    if path is None:
        return ()
    first = model_module(path)
    model = ModelSpec(path).build()
    names = [first, *(type(m).__module__ for m in model.modules())]
    config = getattr(model, "config", None)
    if config is not None:
        names.append(type(config).__module__)
    return tuple(dict.fromkeys(n for n in names if n and n != "__main__" and not n.startswith("torch.")))


__all__ = ["ModelSpec", "model_module", "model_modules", "weights_digest"]
