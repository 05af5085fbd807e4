"""The weights every battery run starts from: the model's initial weights after a few deterministic updates.

At its initial weights a model predicts every token about equally badly: each supervised token's loss sits near
log V, and the means of any two groups of tokens (two ranks, two microbatches, two sequences) differ only by the
sampling noise of nearly equal numbers. A logged loss that weights tokens wrongly then lands within the float32
lane's relative tolerance (1e-4) of the global token mean, and the logged-loss check cannot see it. After
:data:`WARMUP_STEPS` Adam updates on a few rows of the battery's corpus, the model predicts the corpus's regular tokens
well and its noise tokens, prompts and random tokens badly, so per-token losses differ by whole nats and a
re-weighted mean stands apart (``docs/battery.md`` has the measured pass counts of three such logged losses).

The updates are computed once per model, seed and precision, in the parent with the ranks' one intra-op thread
(:func:`harness.battery.prepare.probe.facts.rank_threads`), and the flat weights are shipped to the ranks
(:func:`load`), so that the ranks, the single-device reference, the logged-loss truth and the diagnosis start from
bitwise the same weights however many threads, or which machine, would otherwise sum differently. A model that cannot
run the warm-up batch (a user's ``--model`` with an unusual input) starts from its initial weights, and the run's notes
say so.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from harness.battery import scenarios
from harness.battery.spec import ModelSpec
from harness.core.microbatch import Microbatch
from harness.data.batching import collate
from harness.data.corpus import Row, make_corpus, split_rows

WARMUP_STEPS = 20
"""Adam updates from the initial weights to the start of every run."""

WARMUP_LR = 1e-2
"""Adam's learning rate for them: a step of about 1e-2 per weight whatever the gradient's scale (a user's model of
any size moves alike), enough in 20 steps for per-token losses to spread over whole nats."""

WARMUP_ROWS = 8
"""Rows of the corpus's validation split (never a battery scenario's row) in the one warm-up microbatch."""

WARMUP_POSITIONS = 32
"""Each warm-up row is cut to this many positions: the corpus's strides show within a few tokens, and a step over
rows of 128 cost ten times as much (0.7 s against 0.07 s for the 20 steps of the built-in model, measured with
other runs sharing the 2 cores)."""


@lru_cache(maxsize=2)
def _rows() -> tuple[Row, ...]:
    return tuple(split_rows(make_corpus(scenarios.BATTERY_CONFIG), "val")[:WARMUP_ROWS])


def warmup_microbatch(max_len: int | None = None) -> Microbatch:
    """The warm-up microbatch: :data:`WARMUP_ROWS` corpus rows of :data:`WARMUP_POSITIONS` positions, fewer for a
    model that takes at most ``max_len`` (:attr:`harness.battery.prepare.probe.facts.ModelFacts.max_len`)."""
    keep = max(min(WARMUP_POSITIONS, WARMUP_POSITIONS if max_len is None else max_len) + 1, 2)
    rows = [dataclasses.replace(r, tokens=r.tokens[:keep], prompt_len=min(r.prompt_len, keep - 1)) for r in _rows()]
    return collate(rows)


def _key(spec: ModelSpec) -> ModelSpec:
    """The spec the start depends on: the bf16 lane's weights are float32 (``ModelSpec.PRECISIONS``), and the
    fingerprint of the initial weights changes nothing."""
    return dataclasses.replace(spec, precision="fp32" if spec.precision == "bf16" else spec.precision, digest=None)


@lru_cache(maxsize=64)
def _start(spec: ModelSpec) -> tuple[torch.Tensor | None, str | None]:
    from harness.battery.prepare.probe.facts import rank_threads
    from harness.core.compare import flat_params

    max_len = None
    if spec.path is not None:
        from harness.battery.prepare.probe.facts import probe_model

        max_len = probe_model(dataclasses.replace(spec, init_seed=None, precision="fp32")).max_len
    mb = warmup_microbatch(max_len)
    with rank_threads(), torch.random.fork_rng(devices=[]), torch.enable_grad():
        model = spec.build()
        torch.manual_seed(spec.seed)  # a model that draws in its forward draws the same on every call
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=WARMUP_LR)
        try:
            for _ in range(WARMUP_STEPS):
                opt.zero_grad(set_to_none=True)
                loss = spec.loss_sum(model, mb) / mb.supervised
                loss.backward()
                opt.step()
        except Exception as exc:
            text = str(exc).strip().splitlines()
            return None, (f"the logged loss and every gradient are judged at the model's initial weights: its warm-up "
                          f"on {WARMUP_ROWS} corpus rows failed ({type(exc).__name__}: {text[0] if text else ''})")
        params = flat_params(model).detach().clone()
    if not bool(torch.isfinite(params).all()):
        return None, ("the logged loss and every gradient are judged at the model's initial weights: its warm-up "
                      f"({WARMUP_STEPS} Adam steps at {WARMUP_LR:g}) left non-finite weights")
    return params, None


def start_weights(spec: ModelSpec) -> torch.Tensor | None:
    """The flat weights (model order, ``spec``'s dtype) a run of ``spec`` starts from; None: the initial weights
    (the model could not run the warm-up; :func:`start_note` says why)."""
    return _start(_key(spec))[0]


def start_note(spec: ModelSpec) -> str | None:
    """Why a run of ``spec`` starts from the initial weights, or None when it starts from the warmed ones."""
    return _start(_key(spec))[1]


def load(model: nn.Module, flat: torch.Tensor | np.ndarray | None) -> nn.Module:
    """Copy the flat weights ``flat`` (model order) into ``model``'s parameters, cast to each one's dtype; None leaves
    the model as it is. Buffers keep their initial values on the ranks and in the reference alike (a train-mode
    forward reads a batch's statistics, not the running ones)."""
    if flat is None:
        return model
    flat = torch.as_tensor(flat)
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p).to(device=p.device, dtype=p.dtype))
            offset += n
    return model


def starting_model(spec: ModelSpec) -> nn.Module:
    """A fresh single-device model of ``spec`` (its precision's dtype) at the weights its runs start from."""
    return load(spec.build(), start_weights(spec))


__all__ = ["WARMUP_LR", "WARMUP_POSITIONS", "WARMUP_ROWS", "WARMUP_STEPS", "load", "start_note", "start_weights",
           "starting_model", "warmup_microbatch"]
