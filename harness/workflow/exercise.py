"""Seed 000's exercise on real ranks: rank 0 keeps 12 supervised tokens while rank 1 goes from 12 to 36, and the
gradients both normalizations produce against the single-device reference (``python -m harness exercise``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from harness.core.microbatch import Microbatch
from harness.core.reference import reference_gradient
from harness.data.batching import collate
from harness.data.config import Config
from harness.data.corpus import Row, make_corpus
from harness.model import build_model
from harness.recipes import CORRECT_RECIPE
from harness.workflow.outputs import BadInput, Progress, silent
from harness.workflow.protocol import MEAN_OF_MEANS, ddp_parity, token_counts

EXERCISE_RANK0 = 12
EXERCISE_RANK1 = (12, 36)
"""Seed 000's exercise: rank 0 keeps 12 supervised tokens, rank 1 goes from 12 to 36."""


def exercise_windows(config: Config, rows: Sequence[Row]) -> tuple[list[list[list[Microbatch]]], list[list[int]]]:
    """Two real windows for two ranks: rank 0 holds 12 supervised tokens in both; rank 1 holds 12, then 36.

    Rank 1's 36 tokens extend the same sequences that gave its 12 (longer prefixes of the same rows), so what
    changes is how many tokens it carries, not which kind.
    """
    acc = config.accumulation
    for n in (EXERCISE_RANK0, *EXERCISE_RANK1):
        if n % acc:
            msg = f"accumulation={acc} must divide the exercise's token counts 12 and 36; set 1, 2, 3, 4, 6 or 12"
            raise BadInput(msg)
    need = max(EXERCISE_RANK1) // acc + 1
    # No prompt: every target of a truncated row is supervised, so k + 1 tokens give exactly k.
    usable = [r for r in rows if r.split == "train" and r.prompt_len == 0 and len(r.tokens) >= need]
    if len(usable) < 2 * acc:
        msg = (f"the corpus has {len(usable)} prompt-free training rows of at least {need} tokens, the exercise needs "
               f"{2 * acc}; raise train_size or max_len, or lower prompt_fraction")
        raise BadInput(msg)

    def rank_window(chosen: Sequence[Row], tokens: int) -> list[Microbatch]:
        per = tokens // acc
        mbs = []
        for r in chosen:
            mb = collate([Row(r.id, r.split, r.tokens[: per + 1], 0)])
            assert mb.supervised == per
            mbs.append(mb)
        return mbs

    rank0, rank1 = usable[:acc], usable[acc : 2 * acc]
    windows = [[rank_window(rank0, EXERCISE_RANK0), rank_window(rank1, n1)] for n1 in EXERCISE_RANK1]
    return windows, [token_counts(w) for w in windows]


def _local_losses(config: Config, window: Sequence[Sequence[Microbatch]]) -> tuple[list[float], list[int]]:
    from harness.core.loss import loss_sum

    model = build_model(config, dropout=0.0)
    with torch.no_grad():
        sums = [sum(float(loss_sum(model(mb.inputs), mb.labels).double()) for mb in rank) for rank in window]
    return sums, token_counts(window)


def implied_weight(average: float, mean0: float, mean1: float) -> float | None:
    """Rank 0's weight ``w`` in ``average = w * mean0 + (1 - w) * mean1``, read off the measured numbers (None when the
    two local means are equal and any weight fits)."""
    return None if mean0 == mean1 else (average - mean1) / (mean0 - mean1)


def run_exercise(config: Config, progress: Progress = silent) -> dict[str, Any]:
    """Seed 000's exercise on real ranks: how each average moves, and the gradients both normalizations produce.

    ``measured`` holds each layout's local means and both averages from the model's losses, and the weight rank 0
    has in each average, recovered from those numbers by :func:`implied_weight` (not set by hand).
    """
    if config.world_size != 2:
        msg = f"world_size={config.world_size}: the exercise is written for two ranks; set world_size: 2 in the config"
        raise BadInput(msg)
    rows = make_corpus(config)
    windows, counts = exercise_windows(config, rows)
    # The seed's hand calculation: 1 per token on rank 0, 3 on rank 1, before and after.
    seed = []
    for n0, n1 in counts:
        sums = [1.0 * n0, 3.0 * n1]
        seed.append({"tokens": [n0, n1], "mean_of_means": (sums[0] / n0 + sums[1] / n1) / 2,
                     "global_mean": (sums[0] + sums[1]) / (n0 + n1)})
    measured = []
    refs = []
    for window in windows:
        sums, n = _local_losses(config, window)
        means = [s / c for s, c in zip(sums, n)]
        mean_of_means, global_mean = sum(means) / len(means), sum(sums) / sum(n)
        measured.append({"tokens": n, "local_means": means, "mean_of_means": mean_of_means, "global_mean": global_mean,
                         "short_rank_weight_mean_of_means": implied_weight(mean_of_means, *means),
                         "short_rank_weight_global": implied_weight(global_mean, *means)})
        refs.append(reference_gradient(build_model(config, dropout=0.0), window).gradient)
    gradients: dict[str, dict[str, Any]] = {}
    for recipe in (CORRECT_RECIPE, MEAN_OF_MEANS):
        progress(f"  exercise: {recipe.split(':')[-1]} on 2 ranks, layouts {counts}")
        result = ddp_parity(config, recipe, windows, refs)
        rows_out = []
        for k, (c, grad) in enumerate(result):
            rows_out.append({"tokens": counts[k], "gradient_norm": float(grad.double().norm()),
                             "max_abs_error": c.max_abs_error, "worst_ratio": c.worst_ratio,
                             "over_tolerance": c.over_tolerance, "matches_reference": c.passed})
        moved = float((result[1][1].double() - result[0][1].double()).abs().max())
        gradients[recipe.split(":")[-1]] = {"layouts": rows_out, "moved_max_abs": moved}
    good = [row["matches_reference"] for row in gradients["global_token_mean"]["layouts"]]
    control = [row["matches_reference"] for row in gradients["mean_of_local_means"]["layouts"]]
    # Equal counts make the two normalizations coincide; only the uneven layout can tell them apart.
    holds = good == [True, True] and control == [True, False]
    return {"seed_arithmetic": seed, "measured": measured, "gradients": gradients,
            "components": int(refs[0].numel()), "passed": bool(holds)}
