"""Models shaped like the ones users bring, each with the property the battery must handle without blaming the recipe:
BatchNorm, a parameter no forward uses, an expert only long rows reach, a forward that reads a buffer it updates, a
position table shorter than the battery's rows, and a forward that computes part of itself in float32.

Every model takes ``model(input_ids)`` (and ``attention_mask=`` for the hf format) and returns logits ``[B, T, V]``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

VOCAB = 32
"""The battery config's vocabulary size."""

PAD = 0


class _Base(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)

    def body(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return x

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        # A causal running mean: each position sees itself and what came before.
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        x = torch.tanh(self.mix(torch.cumsum(x, dim=1) / steps))
        return self.head(self.body(x, input_ids))


class BatchNormLM(_Base):
    """A BatchNorm over the channels (every position of every row is one sample): in train mode it raises "Expected
    more than 1 value per channel when training" on a microbatch of one row and one position."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def body(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


class UnusedHeadLM(_Base):
    """A value head built for another task (a reward or classification head) that the language-model forward never
    calls: its parameters require grad and never get one."""

    def __init__(self) -> None:
        super().__init__()
        self.value_head = nn.Linear(16, 1)


class RoutedLM(_Base):
    """Two experts, each row routed by its length: rows longer than ``LONG`` tokens go to ``experts.1``. An expert
    with no row is skipped, as mixture-of-experts layers do, so on a rank whose rows are all short ``experts.1``
    gets no gradient while the other ranks' does: a parameter unused on some ranks only."""

    LONG = 100

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def body(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        long = (input_ids != PAD).sum(dim=1) > self.LONG
        out = torch.zeros_like(x)
        for e, rows in enumerate((~long, long)):
            if bool(rows.any()):
                out[rows] = self.experts[e](x[rows])
        return x + out


def routed_expert_hidden_from_ddp() -> RoutedLM:
    """The routed model with its long-row expert hidden from DDP (``_ddp_params_and_buffers_to_ignore``, as code
    that manages an expert's gradients itself does): never synchronized, its gradient is zero on a rank with no long
    row and nonzero on the others."""
    model = RoutedLM()
    model._ddp_params_and_buffers_to_ignore = ["experts.1.weight", "experts.1.bias"]
    return model


class CountingLM(_Base):
    """A forward that reads a buffer it updates (a call counter scaling the hidden state): the same input gives
    another output on every call, so the single-device reference (one call per microbatch of every rank) and the
    ranks (one call per own microbatch) compute different functions."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def body(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * (1 + 0.05 * self.calls)


class ShortPositionsLM(_Base):
    """A learned position table of 64 entries: rows longer than that are out of its reach (it raises IndexError)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(64, 16)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = torch.tanh(self.mix(self.embed(input_ids) + self.pos(positions)))
        return self.head(torch.cumsum(x, dim=1))


class Float32InsideLM(_Base):
    """Computes its hidden state in float32 whatever the model's dtype (the way RMSNorm implementations upcast),
    then casts back: in a float64 run part of the model is float32 arithmetic, the same on the ranks and in the
    reference."""

    def body(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h.to(x.dtype)


class ThreadsSeen(_Base):
    """Records the intra-op thread count each forward ran with (class-wide, read by the test in the parent)."""

    seen: ClassVar[list[int]] = []

    def body(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ThreadsSeen.seen.append(torch.get_num_threads())
        return x
