"""Negative controls, normalization family. How the loss is normalized: the wrong denominator (a local count, one
microbatch's count, a count cached from an earlier window, a count rounded to float16 or bfloat16), a missing or extra
factor (W, k), a mean per microbatch or per sequence, and a loss computed in float32.

Each class declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.core.formats import supervised_tokens
from harness.core.loss import check_global_count, global_count, global_token_loss
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.recipes.catalog import Target, control
from harness.recipes.correct import _sync_last, _world_size, accumulate, window_count


@control(Target("parity", "uneven"), "mean_of_local_means")
class MeanOfLocalMeans:
    """Seed 000's ``wrong=True``: each rank divides by its *local* count, and DDP averages the local means.

    Right only when every rank holds the same number of tokens (or the same local mean), which is why the battery's
    uneven fixture exists.
    """

    name = "mean_of_local_means"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        local = sum(supervised_tokens(mb) for mb in window)  # either batch format: the mistake is the same
        accumulate(model, window, lambda s: s / max(local, 1))
        return None


@control(Target("parity", "long"), "global_scale")
class ExtraMicrobatchDivision:
    """The correct normalization, then divided again by the number of microbatches (seed 000: 2.5 becomes 1.25)."""

    name = "extra_microbatch_division"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world) / len(window))
        return None


@control(Target("parity", "uneven"), "global_scale")
class NoWorldSizeFactor:
    """Each rank backpropagates ``S_r / N``: DDP's average then divides the gradient by W once too often."""

    name = "no_world_size_factor"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total = window_count(window)
        accumulate(model, window, lambda s: s / total)
        return None


@control(Target("parity", "uneven", precision="fp64"), "float32_computation")
class Float32Loss:
    """The correct recipe computing its loss in float32 (a stray ``.float()``, an autocast region).

    Invisible at float32, where it changes nothing; the float64 lane sees the lost digits.
    """

    name = "float32_loss"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world), loss_dtype=torch.float32)
        return None


@control(Target("parity", "uneven"), "per_microbatch_mean")
class PerMicrobatchMean:
    """Each microbatch's own token mean (``reduction="mean"``), divided by the microbatch count: the loop most
    tutorials write. Every microbatch weighs the same whatever its token count, and DDP averages the ranks."""

    name = "per_microbatch_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        window_count(window)
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                logits = model(mb.inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX)
                (loss / len(window)).backward()
        return None


@control(Target("parity", "uneven"), "global_scale")
class CountFromOneMicrobatch:
    """Estimates the window's count as (first microbatch's count) x (number of microbatches): right only when every
    microbatch of a rank holds the same number of supervised tokens."""

    name = "count_from_one_microbatch"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total = global_count(window[0].supervised * len(window))
        check_global_count(total)
        accumulate(model, window, lambda s: global_token_loss(s, total, _world_size()))
        return None


@control(Target("parity", "varying"), "global_scale", only_its_scenario=True)
class CachedCount:
    """Computes the global count on its first window and keeps it on the recipe: every later window is normalized
    by the first window's count."""

    name = "cached_count"

    def __init__(self) -> None:
        self.total: int | None = None

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        if self.total is None:
            self.total = window_count(window)
        total = self.total
        accumulate(model, window, lambda s: global_token_loss(s, total, _world_size()))
        return None


@control(Target("parity", "uneven"), "per_sequence_mean")
class PerSequenceMean:
    """Each sequence's own token mean, averaged over the rank's sequences (the "mean over each sequence, then over the
    batch" loss of sequence-level training loops); DDP averages the ranks. A sequence weighs the same whatever its
    length, so a long sequence's tokens weigh less than a short one's."""

    name = "per_sequence_mean"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        window_count(window)
        rows = sum(mb.inputs.shape[0] for mb in window)
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                logits = model(mb.inputs)
                per_token = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX,
                                            reduction="none").view(mb.labels.shape)
                counts = (mb.labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)
                ((per_token.sum(dim=1) / counts).sum() / rows).backward()
        return None


@control(Target("parity", "long"), "global_scale")
class Float16Count:
    """The count all-reduced as float16 (a count tensor made in the dtype of an fp16 loop's loss): float16 holds every
    integer only up to 2048, so the sum of the ranks' counts rounds, and a window of 2051 tokens is divided by 2052.
    Exact on every window of up to 2048 tokens; the ``long`` scenario holds an odd count over 2048 at every world
    size (``harness.battery.scenarios.long``)."""

    name = "float16_count"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        count = torch.tensor([float(sum(supervised_tokens(mb) for mb in window))], dtype=torch.float16)
        if dist.is_initialized():
            dist.all_reduce(count)
        total = float(count)
        check_global_count(total)  # type: ignore[arg-type]
        accumulate(model, window, lambda s: global_token_loss(s, total, _world_size()))  # type: ignore[arg-type]
        return None


@control(Target("parity", "long", precision="bf16", world_sizes=(2, 4)), "unexplained")
class Bfloat16Count:
    """The all-reduced count rounded to bfloat16 before the division (``count.to(logits.dtype)`` in a bf16 loop):
    8 significant bits hold every integer only up to 256, so every gradient is scaled by ``N / round_bf16(N)``, by
    0.1-0.4% on the battery's windows. The bf16 lane's relative-L2 bound (about 1.7e-2) cannot see so small a
    scale; its least-squares scale test can (``harness.battery.prepare.bf16``), where the rounding stands above twice
    the correct computation's own scale noise: on ``long`` at W=2 and 4, not at W=3, where the correct computation's
    own bf16 scale offset at the battery's weights runs against the rounding's (docs/fsdp2-bf16-clipping.md)."""

    name = "bfloat16_count"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total = float(torch.tensor(float(window_count(window))).to(torch.bfloat16))
        accumulate(model, window, lambda s: global_token_loss(s, total, _world_size()))  # type: ignore[arg-type]
        return None


@control(Target("parity", "uneven"), "weighted_by_real_tokens")
class WeightedByRealTokens:
    """Each microbatch's mean over its supervised tokens, weighted by its real (non-padding) tokens over the window's,
    all-reduced (composer #3677): the weight comes from the attention mask's count, which holds prompt tokens and each
    row's last position, while the loss averages the supervised ones. Right only where every microbatch holds real
    and supervised tokens in one proportion."""

    name = "weighted_by_real_tokens"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        check_global_count(global_count(sum(supervised_tokens(mb) for mb in window)))
        real = global_count(sum(int((mb.inputs != PAD).sum()) for mb in window))
        world = _world_size()
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                n = supervised_tokens(mb)
                s = F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
                (s / max(n, 1) * int((mb.inputs != PAD).sum()) / real * world).backward()
        return None


@control(Target("parity", "uneven"), "prompt_supervised")
class PromptTokensSupervised:
    """Labels rebuilt from the input ids (each real position's target the next input token), as a loop that builds
    ``labels = input_ids.clone()`` does: the prompt, which the batch marks -100, is supervised too, and the count is
    taken from the rebuilt labels. Right only where the windows hold no prompt."""

    name = "prompt_tokens_supervised"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        rebuilt = []
        for mb in window:
            nxt = torch.full_like(mb.inputs, PAD)
            nxt[:, :-1] = mb.inputs[:, 1:]
            fill = (mb.labels == IGNORE_INDEX) & (mb.inputs != PAD) & (nxt != PAD)
            rebuilt.append(torch.where(fill, nxt, mb.labels))
        total = global_count(sum(int((labels != IGNORE_INDEX).sum()) for labels in rebuilt))
        check_global_count(total)
        world = _world_size()
        for i, (mb, labels) in enumerate(zip(window, rebuilt)):
            with _sync_last(model, i, len(window)):
                s = F.cross_entropy(model(mb.inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
                (s * world / total).backward()
        return None
