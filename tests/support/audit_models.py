"""A model called the Hugging Face way and its padded batches, for the audit's tests (in one process, and in the ranks
the launcher starts, which import this module as ``support.audit_models``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from harness.core.microbatch import IGNORE_INDEX
from harness.data.config import Config
from harness.model import build_model


class HFLike(nn.Module):
    """A causal LM called the Hugging Face way: ``model(input_ids=..., attention_mask=..., labels=...)`` returns
    ``.logits`` and ``.loss``, the mean cross-entropy of the shifted labels."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = build_model(Config(dropout=0.0), seed=3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> SimpleNamespace:
        logits = self.lm(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
        return SimpleNamespace(logits=logits, loss=loss)


def batch(lengths: list[int], seed: int, left: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded rows (``left``: left-padded) of the given lengths, the padding labelled -100."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        where = slice(width - n, width) if left else slice(0, n)
        ids[i, where] = torch.randint(1, 32, (n,), generator=g)
        mask[i, where] = 1
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def accumulate(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[dict[str, torch.Tensor]], right: bool,
               step: bool = True) -> None:
    """One window of the loops under audit, Hugging Face batches: ``right``, each microbatch's mean loss times its
    count over the window's (the loss sum over the global count, in one process); else each mean over the
    accumulation steps (a mean per microbatch). Then the optimizer steps (``step``) and the gradients are cleared."""
    n = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in mbs)
    for b in mbs:
        out = model(**b)
        count = int((b["labels"][:, 1:] != IGNORE_INDEX).sum())
        (out.loss * count / n if right else out.loss / len(mbs)).backward()
    if step:
        opt.step()
    opt.zero_grad()
