"""Test (and validation) loss and token accuracy, from all-reduced sums and counts.

Each rank reads its own shard of the split's rows; the ranks' loss sums, correct predictions and supervised counts
are summed over the group and divided once. A mean of rank means would weight a rank holding short sequences as much
as one holding long ones: the same bias the battery's negative control shows for gradients.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.core.loss import count_device, loss_sum
from harness.core.microbatch import IGNORE_INDEX
from harness.data.batching import collate
from harness.data.config import Config
from harness.data.corpus import Row, split_rows
from harness.resume.atomic import write_atomic

EVAL_FILE = "eval.json"
EVAL_BATCH = 32


def split_totals(model: nn.Module, rows: Sequence[Row], device: torch.device, rank: int, world: int) -> list[float]:
    """This rank's ``[loss sum, correct, supervised]`` over rows ``rank, rank + world, ...`` of ``rows``."""
    loss, correct, count = 0.0, 0, 0
    mine = list(rows)[rank::world]
    for i in range(0, len(mine), EVAL_BATCH):
        mb = collate(mine[i : i + EVAL_BATCH], device)
        logits = model(mb.inputs)
        supervised = mb.labels != IGNORE_INDEX
        loss += float(loss_sum(logits, mb.labels).double())
        correct += int(((logits.argmax(dim=-1) == mb.labels) & supervised).sum())
        count += int(supervised.sum())
    return [loss, float(correct), float(count)]


def evaluate_model(
    model: nn.Module, rows: Sequence[Row], config: Config, device: torch.device, splits: Sequence[str] = ("val", "test")
) -> dict[str, Any]:
    """Loss per supervised token and token accuracy of each split; every rank calls it and gets the same numbers.

    ``model`` is the bare module (not the DDP wrapper): evaluation needs no gradient synchronization. It runs in eval
    mode (no dropout, so no RNG draw) and is put back in its previous mode afterwards.
    """
    initialized = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            totals = [v for s in splits for v in split_totals(model, split_rows(rows, s), device, rank, world)]
    finally:
        model.train(was_training)
    t = torch.tensor(totals, dtype=torch.float64, device=count_device() if initialized else torch.device("cpu"))
    if initialized:
        dist.all_reduce(t)  # sums and counts, never means: the one division below happens after the reduction
    result: dict[str, Any] = {}
    for j, s in enumerate(splits):
        loss, correct, count = (float(x) for x in t[3 * j : 3 * j + 3])
        if count == 0:
            msg = (
                f"split {s!r} has no supervised tokens ({len(split_rows(rows, s))} sequences, no label to score): "
                "its loss and accuracy would be 0/0; give the split labelled sequences, or leave it out of splits"
            )
            raise ValueError(msg)
        result[f"{s}_loss"] = loss / count
        result[f"{s}_accuracy"] = correct / count
        result[f"{s}_sequences"] = len(split_rows(rows, s))
        result[f"{s}_tokens"] = int(count)
    return result


def write_eval(run_dir: str | Path, result: dict[str, Any], *, step: int) -> Path:
    """Rank 0 only: ``run_dir/eval.json`` with the step it describes, written whole (temporary, fsync, rename)."""
    path = Path(run_dir) / EVAL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps({"step": step, **result}, indent=2, sort_keys=True) + "\n").encode())
    return path


__all__ = ["EVAL_FILE", "evaluate_model", "split_totals", "write_eval"]
