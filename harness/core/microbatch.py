"""Microbatches: padded inputs and aligned labels.

For a sequence ``x`` of length L the model reads ``x[0 .. L-2]`` and the label at position ``t`` is ``x[t+1]``:
labels are aligned, so ``labels[b, t]`` is the target for ``logits[b, t]`` and no recipe has to shift anything.
Padding positions and targets inside the prompt get ``IGNORE_INDEX`` and never enter a denominator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = 0
"""Input id at padding positions."""

IGNORE_INDEX = -100
"""Label at every position that is not supervised (padding, prompt prefix); cross-entropy's default ignore index."""


@dataclass(frozen=True)
class Microbatch:
    """One forward pass worth of rows on one rank."""

    inputs: torch.Tensor
    """int64 ``[B, T]``; ``PAD`` after each row's end."""

    labels: torch.Tensor
    """int64 ``[B, T]``; the target for the same position, ``IGNORE_INDEX`` where not supervised."""

    weights: torch.Tensor | None = None
    """float64 ``[B, T]``, the per-token factor of the loss where the declared objective has one (the weights of
    ``weighted_token_mean``, the advantages a policy-gradient recipe asks for: :mod:`harness.core.objectives`), 0 where
    not supervised; None where the objective needs none (then every factor is 1)."""

    positions: torch.Tensor | None = None
    """int64 ``[B, T]``, each column's position in its full sequence, where the microbatch holds a part of its rows'
    positions (a cp rank's chunk of a sequence-sharding model: :func:`harness.data.context_parallel.shard_chunk`);
    None where it holds them all, in order (``0 .. T-1``). A model that shards the sequence reads them as
    ``position_ids``."""

    counts: torch.Tensor | None = None
    """int64 ``[B]``, each row's supervised count in its whole sequence, where the microbatch holds a part of its rows'
    supervised positions (the diagnosis's block of one cp rank's chunk: :func:`harness.diagnosis.mesh.token_blocks`);
    None where its labels hold them all. A per-sequence objective divides each row's tokens by it
    (:func:`harness.core.objectives.coefficients`)."""

    def __post_init__(self) -> None:
        for name in ("inputs", "labels"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 2:
                msg = f"Microbatch.{name} must be an int64 tensor [B, T], got {_describe(t)}"
                raise TypeError(msg)
        if self.inputs.shape != self.labels.shape or self.inputs.shape[0] < 1:
            msg = (
                f"Microbatch inputs {tuple(self.inputs.shape)} and labels {tuple(self.labels.shape)} must have the "
                "same shape [B, T] with B >= 1"
            )
            raise ValueError(msg)
        w = self.weights
        if w is not None and (not isinstance(w, torch.Tensor) or not w.is_floating_point()
                              or w.shape != self.labels.shape):
            msg = f"Microbatch.weights must be None or a float tensor of the labels' shape [B, T], got {_describe(w)}"
            raise TypeError(msg)
        p = self.positions
        if p is not None and (not isinstance(p, torch.Tensor) or p.dtype != torch.int64
                              or p.shape != self.labels.shape):
            msg = (f"Microbatch.positions must be None or an int64 tensor of the labels' shape [B, T], got "
                   f"{_describe(p)}")
            raise TypeError(msg)
        c = self.counts
        if c is not None and (not isinstance(c, torch.Tensor) or c.dtype != torch.int64
                              or c.shape != self.labels.shape[:1]):
            msg = f"Microbatch.counts must be None or an int64 tensor [B] (one count per row), got {_describe(c)}"
            raise TypeError(msg)

    @property
    def supervised(self) -> int:
        """Positions that count in the loss (and in the denominator)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str) -> Microbatch:
        weights = None if self.weights is None else self.weights.to(device)
        positions = None if self.positions is None else self.positions.to(device)
        counts = None if self.counts is None else self.counts.to(device)
        return Microbatch(self.inputs.to(device), self.labels.to(device), weights, positions, counts)

    def row(self, i: int) -> Microbatch:
        """Row ``i`` alone, as a one-row microbatch (its weights with it)."""
        weights = None if self.weights is None else self.weights[i : i + 1]
        positions = None if self.positions is None else self.positions[i : i + 1]
        counts = None if self.counts is None else self.counts[i : i + 1]
        return Microbatch(self.inputs[i : i + 1], self.labels[i : i + 1], weights, positions, counts)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__
