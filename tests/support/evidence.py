"""Evidence built by hand, with no launch: a small model and its loss convention, microbatches of chosen lengths, and
a rank's gradient made from the blocks' own gradients with chosen weights (what a loop that weighs its microbatches
so would have synchronized)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from harness.core.compare import flat_grad, flat_params
from harness.core.formats import HARNESS
from harness.core.loss import loss_sum
from harness.core.mesh import Mesh
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.core.objectives import PLAIN, Objective
from harness.core.reference import Reference
from harness.data.config import Config
from harness.diagnosis.evidence import Evidence, RankWindow
from harness.model import build_model

CONFIG = Config(dropout=0.0)


@dataclasses.dataclass(frozen=True)
class TinyConvention:
    """The built-in causal LM at a tiny size, under the aligned-label convention: the loss sum over supervised
    positions of ``model(mb.inputs)``."""

    seed: int = 0
    dtype: torch.dtype = torch.float32
    path: str | None = None
    batch_format: str = HARNESS

    def build(self) -> nn.Module:
        model = build_model(CONFIG, seed=self.seed).to(self.dtype)
        model.train()
        return model

    def loss_sum(self, model: nn.Module, mb: Microbatch) -> torch.Tensor:
        return loss_sum(model(mb.inputs), mb.labels)

    def logits(self, model: nn.Module, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
        raw = model(mb.inputs)
        return raw, raw

    def reference_batch(self, mb: Microbatch) -> object:
        return mb


def microbatch(lengths: Sequence[int], seed: int, prompt: int = 0) -> Microbatch:
    """Rows of the given lengths (right-padded), labels the next token, the first ``prompt`` positions unsupervised."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    inputs = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), IGNORE_INDEX, dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(1, CONFIG.vocab_size, (n + 1,), generator=g)
        inputs[i, :n] = row[:-1]
        labels[i, prompt:n] = row[1 + prompt :]
    return Microbatch(inputs, labels)


def block_gradients(convention: TinyConvention, params: torch.Tensor, mbs: Sequence[Microbatch],
                    objective: Objective = PLAIN) -> list[torch.Tensor]:
    """Each microbatch's gradient of its loss sum at the flat weights ``params``, in float64."""
    model = convention.build().double()
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(params[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    out = []
    for mb in mbs:
        model.zero_grad(set_to_none=True)
        convention.loss_sum(model, mb).backward()
        out.append(flat_grad(model))
    return out


def hand_evidence(windows: Sequence[Sequence[Microbatch]], weights: Sequence[float] | None = None, *,
                  mesh: Mesh | None = None, objective: Objective = PLAIN, precision: str = "fp64",
                  grads: Sequence[torch.Tensor] | None = None, **fields: object) -> Evidence:
    """One window of ``windows[data_rank][microbatch]``: every rank's synchronized gradient is the blocks' gradients
    weighted by ``weights`` (one per microbatch, in data-rank order; None: each ``1/N``, the right weighting), or
    ``grads`` given rank by rank; the reference is the right weighting; every rank started from the model's initial
    weights. ``fields`` set any other field of :class:`Evidence`."""
    convention = TinyConvention(dtype=torch.float64 if precision == "fp64" else torch.float32)
    mesh = mesh or Mesh.data_parallel(len(windows))
    start = flat_params(convention.build()).detach().clone()
    flat_mbs = [mb for rank in windows for mb in rank]
    blocks = block_gradients(convention, start, flat_mbs)
    n = sum(mb.supervised for mb in flat_mbs)
    right = sum(b / n for b in blocks)
    assert isinstance(right, torch.Tensor)
    if grads is None:
        weights = [1 / n] * len(blocks) if weights is None else weights
        g = sum(w * b for w, b in zip(weights, blocks))
        assert isinstance(g, torch.Tensor)
        grads = [g] * mesh.world_size
    dtype = torch.float64 if precision == "fp64" else torch.float32
    records = [[RankWindow(grad=grad.to(dtype), params_before=start, syncs=1)] for grad in grads]
    reference = Reference(gradient=right.to(dtype), loss=0.0, tokens=n)
    defaults: dict[str, object] = {"references": [reference], "reference_starts": [start], "objective": objective,
                                   "precision": precision, "recipe": "a hand-built evidence", "scenario": "by hand"}
    return Evidence(windows=[windows], records=records, model=convention, mesh=mesh, **{**defaults, **fields})  # type: ignore[arg-type]


__all__ = ["CONFIG", "TinyConvention", "block_gradients", "hand_evidence", "microbatch"]
