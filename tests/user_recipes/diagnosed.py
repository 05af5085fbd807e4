"""Training steps written the way users write them (torch only; the last one extends the harness's load-balancing
recipe), each with one mistake the diagnosis must name for what it is: an auxiliary loss, a fixed accumulation
constant, the world size divided out twice, a stale first count, a count rounded to bf16 or one too large, an
unnormalized sum, W times a rank's own count, an FSDP2 sync never re-enabled, a mild re-weighting, a token mean per
microbatch under the sequence mean. ``tests/distributed/test_diagnosis.py`` and ``test_window_readings.py`` read each
one; ``right_token_mean`` and ``fsdp2_right`` are their correct counterparts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def _loop(model: torch.nn.Module, window: Sequence[Any],
          loss_of: Callable[[int, Any, torch.Tensor, int, int], torch.Tensor]) -> None:
    """The usual accumulation loop: ``no_sync()`` on all but the last microbatch; ``loss_of(i, mb, token_sum, local,
    total)`` is the microbatch's loss, from its summed token loss, this rank's count and the global count."""
    local = sum(int((mb.labels != IGNORE).sum()) for mb in window)
    count = torch.tensor([local])
    dist.all_reduce(count)
    total = int(count)
    if total == 0:
        raise ValueError("no supervised token in this window on any rank")
    for i, mb in enumerate(window):
        last = i == len(window) - 1
        with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
            logits = model(mb.inputs)
            s = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE, reduction="sum")
            loss_of(i, mb, s, local, total).backward()


class AuxiliaryL2Penalty:
    """The right token mean, plus an L2 penalty on one layer's weights added to every microbatch's loss (a
    regularizer written into the loss, as an auxiliary load-balancing loss is): the gradient holds a term no
    re-weighting of the token losses makes, carried by ``blocks.0.mlp.2.weight``."""

    name = "auxiliary_l2_penalty"
    layer = "blocks.0.mlp.2.weight"
    strength = 1e-3

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()
        weight = dict(_unwrapped(model).named_parameters())[self.layer]

        def loss(i: int, mb: Any, s: torch.Tensor, local: int, total: int) -> torch.Tensor:
            return s * world / total + self.strength * weight.pow(2).sum()

        _loop(model, window, loss)


class FixedAccumulationConstant:
    """Each microbatch's own mean divided by the accumulation steps of its configuration (``K=4``), whatever the
    window holds: right in weight only for windows of four microbatches of equal counts."""

    name = "fixed_accumulation_constant"
    accumulation_steps = 4

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        def loss(i: int, mb: Any, s: torch.Tensor, local: int, total: int) -> torch.Tensor:
            return s / max(int((mb.labels != IGNORE).sum()), 1) / self.accumulation_steps

        _loop(model, window, loss)


class WorldSizeDividedTwice:
    """The global token mean, then divided by the world size "because DDP sums" (it averages): every token weighs
    ``1/(W^2 N)``."""

    name = "world_size_divided_twice"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()

        def loss(i: int, mb: Any, s: torch.Tensor, local: int, total: int) -> torch.Tensor:
            return s / total / world

        _loop(model, window, loss)


class StaleFirstCount:
    """Normalizes the first microbatch before the count's all-reduce has come back (by this rank's local count),
    every later one by the global count: microbatch 0 of each rank weighs ``N / n_r`` times the right weight."""

    name = "stale_first_count"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()

        def loss(i: int, mb: Any, s: torch.Tensor, local: int, total: int) -> torch.Tensor:
            return s * world / (local if i == 0 else total)

        _loop(model, window, loss)


auxiliary_l2_penalty = AuxiliaryL2Penalty()
fixed_accumulation_constant = FixedAccumulationConstant()
world_size_divided_twice = WorldSizeDividedTwice()
stale_first_count = StaleFirstCount()


# --- Scales that are facts of the window, and readings that need the run ------------------------------------------


class WTimesOwnCount:
    """Each rank divides its loss sum by world size times its own token count ("DDP sums, so divide by W"): each
    rank's tokens weigh ``1/(W^2 n_r)``, a mean of local means with the world-size factor missing."""

    name = "w_times_own_count"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()

        def loss(i: int, mb: Any, s: torch.Tensor, local: int, total: int) -> torch.Tensor:
            return s / (world * max(local, 1))

        _loop(model, window, loss)


class UnnormalizedSum:
    """Backpropagates each microbatch's loss sum as it is: every token weighs ``1/W`` after DDP's average."""

    name = "unnormalized_sum"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        _loop(model, window, lambda i, mb, s, local, total: s)


class CountInBf16:
    """All-reduces the token count as a bfloat16 tensor (the dtype of the model's other tensors): each rank's count
    and each partial sum rounds, so the loss is normalized by a count a few tokens off N."""

    name = "count_in_bf16"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()
        local = sum(int((mb.labels != IGNORE).sum()) for mb in window)
        count = torch.tensor([float(local)], dtype=torch.bfloat16)
        dist.all_reduce(count)
        total = float(count)
        if total == 0:
            raise ValueError("no supervised token in this window on any rank")

        def loss(i: int, mb: Any, s: torch.Tensor, local: int, total_: int) -> torch.Tensor:
            return s * world / total

        _loop(model, window, loss)


class CountPlusOne:
    """Adds one to the global count against a division by zero: every token weighs ``1/(N+1)``."""

    name = "count_plus_one"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()
        _loop(model, window, lambda i, mb, s, local, total: s * world / (total + 1))


class Fsdp2SyncNeverReenabled:
    """An FSDP2 loop that turns the gradient sync off before the window and never turns it back on: no
    reduce-scatter runs, and every sharded parameter's ``.grad`` stays None."""

    name = "fsdp2_sync_never_reenabled"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        local = sum(int((mb.labels != IGNORE).sum()) for mb in window)
        count = torch.tensor([local])
        dist.all_reduce(count)
        total = int(count)
        if total == 0:
            raise ValueError("no supervised token in this window on any rank")
        for mb in window:
            logits = model(mb.inputs)
            s = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE, reduction="sum")
            (s * world / total).backward()


class Fsdp2Right:
    """The FSDP2 loop above with the sync re-enabled before the last microbatch's backward: right."""

    name = "fsdp2_right"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()
        local = sum(int((mb.labels != IGNORE).sum()) for mb in window)
        count = torch.tensor([local])
        dist.all_reduce(count)
        total = int(count)
        if total == 0:
            raise ValueError("no supervised token in this window on any rank")
        for i, mb in enumerate(window):
            model.set_requires_gradient_sync(i == len(window) - 1)  # type: ignore[operator]
            logits = model(mb.inputs)
            s = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE, reduction="sum")
            (s * world / total).backward()


class RightTokenMean:
    """The global token mean through the same loop: every reading's control."""

    name = "right_token_mean"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()
        _loop(model, window, lambda i, mb, s, local, total: s * world / total)


right_token_mean = RightTokenMean()
w_times_own_count = WTimesOwnCount()
unnormalized_sum = UnnormalizedSum()
count_in_bf16 = CountInBf16()
count_plus_one = CountPlusOne()
fsdp2_sync_never_reenabled = Fsdp2SyncNeverReenabled()
fsdp2_right = Fsdp2Right()


class AdvantageOwnCount:
    """A policy-gradient loss (``token_weights = "advantages"``: each token's loss times its advantage) divided by
    this rank's own token count, then averaged by DDP: a mean of local means with advantages."""

    name = "advantage_own_count"
    token_weights: str | None = "advantages"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        local = sum(int((mb.labels != IGNORE).sum()) for mb in window)
        count = torch.tensor([local])
        dist.all_reduce(count)
        if int(count) == 0:
            raise ValueError("no supervised token in this window on any rank")
        for i, mb in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
                logits = model(mb.inputs)
                ce = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE,
                                     reduction="none")
                (ce * mb.weights.flatten().to(ce.dtype)).sum().div(max(local, 1)).backward()


class WeightedOwnCount(AdvantageOwnCount):
    """The same loss under drawn token weights (``--objective weighted_token_mean``): divided by this rank's own
    token count where the global weight sum belongs."""

    name = "weighted_own_count"
    token_weights = None


advantage_own_count = AdvantageOwnCount()
weighted_own_count = WeightedOwnCount()


class PositionWeighted:
    """Weighs each token's loss by ``1 + 0.07 * cos(position)`` (a hand-made emphasis on some positions, up to 7% off
    either way) before the right global normalization: a mild re-weighting inside every row, in float32."""

    name = "position_weighted"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()
        local = sum(int((mb.labels != IGNORE).sum()) for mb in window)
        count = torch.tensor([local])
        dist.all_reduce(count)
        total = int(count)
        if total == 0:
            raise ValueError("no supervised token in this window on any rank")
        for i, mb in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
                logits = model(mb.inputs)
                ce = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE,
                                     reduction="none").view(mb.labels.shape)
                emphasis = 1 + 0.07 * torch.cos(torch.arange(mb.labels.shape[1], dtype=ce.dtype))
                (ce * emphasis).sum().mul(world / total).backward()


class LogitsInBf16:
    """The right global token mean with the cross-entropy taken on logits cast to bfloat16 (no autocast: a
    ``.to(torch.bfloat16)`` left in the loss): the gradient carries bf16 rounding, no re-weighting."""

    name = "logits_in_bf16"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        world = dist.get_world_size()
        local = sum(int((mb.labels != IGNORE).sum()) for mb in window)
        count = torch.tensor([local])
        dist.all_reduce(count)
        total = int(count)
        if total == 0:
            raise ValueError("no supervised token in this window on any rank")
        for i, mb in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
                logits = model(mb.inputs).to(torch.bfloat16)
                s = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE,
                                    reduction="sum")
                (s.float() * world / total).backward()


position_weighted = PositionWeighted()
logits_in_bf16 = LogitsInBf16()


class MeanPerMicrobatch:
    """nanoGPT's accumulation: ``F.cross_entropy`` (a token mean over the microbatch) divided by the accumulation
    steps, judged under ``--objective sequence_mean``: each microbatch's tokens weigh ``1/(W k n_rm)``."""

    name = "mean_per_microbatch"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        local = sum(int((mb.labels != IGNORE).sum()) for mb in window)
        count = torch.tensor([local])
        dist.all_reduce(count)
        if int(count) == 0:
            raise ValueError("no supervised token in this window on any rank")
        for i, mb in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
                logits = model(mb.inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=IGNORE)
                (loss / len(window)).backward()


mean_per_microbatch = MeanPerMicrobatch()


def _load_balance_recipe() -> type:
    from harness.recipes.objectives import TokenMeanWithLoadBalance

    class AuxiliaryTimesW(TokenMeanWithLoadBalance):
        """The load-balancing term multiplied by the world size like the main loss and never divided by the
        microbatch count: every auxiliary value weighs ``W * k`` times its unit's ``1/(W k)``."""

        name = "auxiliary_times_w"

        def auxiliary(self, model: torch.nn.Module, mb: Any, raw: torch.Tensor, k: int,
                      tokens: int) -> torch.Tensor | None:
            return self.auxiliary_loss(model, mb, raw) * dist.get_world_size()

    return AuxiliaryTimesW


auxiliary_times_w = _load_balance_recipe()()
