"""Negative controls: each reproduces a mistake real projects made, names where the battery must reject it
(:data:`CONTROLS`), and, for each scenario but the base one, the control that only that scenario catches
(:data:`SCENARIO_CONTROLS`). ``tests/distributed/test_negative_controls.py`` shows each rejected.

One module past the usual size on purpose: a catalog of small, independent classes, each read on its own beside the
correct recipe it departs from. Each class declares its target and expected diagnosis where it is defined
(``@control``, :mod:`harness.recipes.catalog`); the tables are derived from those declarations."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.core.formats import HF, logits_of, supervised_tokens
from harness.core.loss import check_global_count, count_device, global_count, global_token_loss, loss_sum
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.recipes.catalog import Target, control, diagnoses, scenario_controls, targets
from harness.recipes.correct import GlobalTokenMean, _sync_last, _world_size, accumulate, global_sum, window_count

# --- Negative controls -------------------------------------------------------------------------------------------
# Each reproduces a mistake real projects made. The battery must reject every one of them; tests assert that it does.


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


@control(Target("parity", "one_empty", shows_as="desync"), None)
class SkipBackwardWhenEmpty:
    """A rank with no supervised token returns without forward or backward: its peers wait in DDP's all-reduce
    (or, worse, pair with its next collective of the same size)."""

    name = "skip_backward_when_empty"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        if sum(mb.supervised for mb in window) == 0:
            return None
        accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return None


@control(Target("parity", "one_empty", shows_as="desync"), None)
class LocalCountGuard:
    """Guards the empty window with this rank's own count: a rank without tokens raises ValueError and leaves, while
    its peers, whose count is not zero, wait in DDP's all-reduce for it (the guard must use the global count)."""

    name = "local_count_guard"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        if sum(mb.supervised for mb in window) == 0:
            msg = "no supervised token in this window"
            raise ValueError(msg)
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return None


@control(Target("one_sync", "uneven"), "correct")
class NeverNoSync:
    """Right numbers, but every microbatch synchronizes: W-1 extra all-reduces of every gradient per window.
    Parity cannot see it (its gradients pass: ``test_never_using_no_sync_is_invisible_to_parity``); only the
    synchronization count can."""

    name = "never_no_sync"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world), sync_every_microbatch=True)
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


@control(Target("logged_loss", "uneven"), "correct")
class LocalLoggedLoss:
    """Right gradients, but logs this rank's own token mean: the logged loss differs between ranks."""

    name = "local_logged_loss"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        local = accumulate(model, window, lambda s: global_token_loss(s, total, world))
        return local / max(sum(mb.supervised for mb in window), 1)


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


@control(Target("parity", "long"), "dropped")
class TwoMicrobatchLoop:
    """Written for windows of exactly two microbatches: the first under ``no_sync()``, then the last. Right at k=2;
    a one-microbatch window counts its only microbatch twice, and a longer one drops the middle."""

    name = "two_microbatch_loop"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        first, last = window[0], window[-1]
        with model.no_sync():  # type: ignore[operator]
            global_token_loss(loss_sum(model(first.inputs), first.labels), total, world).backward()
        global_token_loss(loss_sum(model(last.inputs), last.labels), total, world).backward()
        return None


@control(Target("one_sync", "long"), "correct")
class SyncKeyedToFirstMicrobatch:
    """Enters ``no_sync()`` for "the first microbatch" instead of "all but the last": k-1 synchronizations, which is
    the right count only when k=2 (k=1 never synchronizes at all)."""

    name = "sync_keyed_to_first_microbatch"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        for i, mb in enumerate(window):
            with model.no_sync() if i == 0 else contextlib.nullcontext():  # type: ignore[operator]
                global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
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


@control(Target("parity", "long"), "dropped", only_its_scenario=True)
class FixedAccumulationSteps:
    """Loops over ``range(accumulation_steps)`` from its own configuration (4) instead of over the window: a window
    of five microbatches loses its fifth, silently."""

    name = "fixed_accumulation_steps"
    accumulation_steps = 4

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        used = [mb for _, mb in zip(range(self.accumulation_steps), window)]
        total = global_count(sum(mb.supervised for mb in used))
        check_global_count(total)
        accumulate(model, used, lambda s: global_token_loss(s, total, _world_size()))
        return None


@control(Target("one_sync", "single"), "not_synchronized", only_its_scenario=True)
class FirstMicrobatchNeverSyncs:
    """Decides "first microbatch: enter no_sync" before "last microbatch: synchronize": right for every window of two
    or more, but a one-microbatch window (a short final window) never synchronizes its gradients."""

    name = "first_microbatch_never_syncs"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        for i, mb in enumerate(window):
            if i == 0:
                ctx = model.no_sync()  # type: ignore[operator]
            elif i == len(window) - 1:
                ctx = contextlib.nullcontext()
            else:
                ctx = model.no_sync()  # type: ignore[operator]
            with ctx:
                global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
        return None


def _masked_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood masked by *multiplication*, as hand-written losses (RL, preference tuning)
    often do: gather the target's log-probability, then ``* mask``. Right where a denominator is non-zero; divided by
    zero, the masked positions' ``0 * inf`` turns every gradient into NaN (``F.cross_entropy`` with ``ignore_index``
    would have zeroed them instead)."""
    mask = (labels != IGNORE_INDEX).to(logits.dtype)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -logp * mask


@control(Target("parity", "one_empty"), "nonfinite", only_its_scenario=True)
class NanOnEmptyRank:
    """Takes this rank's masked token mean and rescales it by ``local * W / N``: the correct gradient, except on a rank
    without supervised tokens, where the mean divides by zero and DDP spreads the NaN gradient to every rank."""

    name = "nan_on_empty_rank"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        local = sum(mb.supervised for mb in window)
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                logits = model(mb.inputs)
                rank_mean = _masked_token_losses(logits, mb.labels).sum() / torch.tensor(float(local))
                (rank_mean * (local * world / total)).backward()
        return None


@control(Target("parity", "sparse"), "nonfinite", only_its_scenario=True)
class NanOnEmptyMicrobatch:
    """Guards a rank without tokens, but not a microbatch without tokens: each microbatch's masked mean (0/0 over no
    token) is rescaled by its count, and its NaN gradient reaches every weight."""

    name = "nan_on_empty_microbatch"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        local = sum(mb.supervised for mb in window)
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                logits = model(mb.inputs)
                if local == 0:
                    loss = logits.sum() * 0.0  # the rank-level guard: keeps the backward (and DDP's sync) going
                else:
                    mean = _masked_token_losses(logits, mb.labels).sum() / torch.tensor(float(mb.supervised))
                    loss = mean * (mb.supervised * world / total)
                loss.backward()
        return None


@control(Target("empty_window", "all_empty"), None, only_its_scenario=True)
class SilentEmptyWindow:
    """Right on every window with tokens; on a window without any it backpropagates zero and returns, so a training
    loop steps its optimizer (momentum, weight decay, the schedule) on nothing."""

    name = "silent_empty_window"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = global_count(sum(mb.supervised for mb in window)), _world_size()
        accumulate(model, window, lambda s: s * (world / max(total, 1)))
        return None


@control(Target("empty_window", "all_empty"), None)
class NanGradientsThenRaise:
    """Backpropagates first and checks the count after: its masked token loss is divided by the all-reduced count
    tensor, which is right on every window with tokens; on a window without any it raises the contract's ValueError,
    but only after 0/0 has left NaN in ``.grad`` for the next window to add to."""

    name = "nan_gradients_then_raise"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        count = torch.tensor(float(sum(mb.supervised for mb in window)), dtype=torch.float64, device=count_device())
        if dist.is_initialized():
            dist.all_reduce(count)
        world = _world_size()
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                logits = model(mb.inputs)
                s = _masked_token_losses(logits, mb.labels).sum()
                (s * world / count.to(s.device, s.dtype)).backward()
        check_global_count(int(count))
        return None


@control(Target("hygiene", "uneven"), "correct")
class PythonRandomShuffle:
    """Shuffles the microbatch order with Python's global ``random``: the gradient is unchanged, but the caller's
    random stream (its data order, its augmentation) is not."""

    name = "python_random_shuffle"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        order = list(window)
        random.shuffle(order)
        total = window_count(order)
        accumulate(model, order, lambda s: global_token_loss(s, total, _world_size()))
        return None


@control(Target("hygiene", "uneven"), "correct")
class NumpyRandomDraw:
    """Draws a keep mask from numpy's global generator (and ignores it): the caller's numpy stream moves."""

    name = "numpy_random_draw"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        np.random.rand(len(window))
        return GlobalTokenMean().backward_window(model, window)


@control(Target("hygiene", "uneven"), "correct")
class TorchRandomDraw:
    """Permutes the microbatches with ``torch.randperm`` on the global generator: the caller's torch stream moves."""

    name = "torch_random_draw"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        order = [window[int(i)] for i in torch.randperm(len(window))]
        return GlobalTokenMean().backward_window(model, order)


# --- Controls of the hf batch format (``--batch-format=hf``: dicts with unshifted labels) ----------------------------


def _hf_window(model: nn.Module, window: Sequence[dict[str, torch.Tensor]],
               pairs: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The correct hf recipe (the right global count, sums, ``no_sync``) except for how it pairs logits with labels:
    ``pairs(logits, labels)`` returns the two aligned tensors the loss compares."""
    total = window_count(window)
    world, local = _world_size(), 0.0
    for i, batch in enumerate(window):
        with _sync_last(model, i, len(window)):
            logits = logits_of(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
            lg, lb = pairs(logits, batch["labels"])
            s = F.cross_entropy(lg.flatten(0, 1), lb.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            (s * (world / total)).backward()
        local += float(s.detach())
    return global_sum(local) / total


@control(Target("parity", "uneven", batch_format=HF), "unexplained")
class HfShiftTwice:
    """Shifts labels that the loss shifts again: the batch's labels are moved one step left "to align them" (as if
    they were the harness's pre-shifted labels), then the HF loss pairs ``logits[:, :-1]`` with ``labels[:, 1:]``, so
    every position is trained on the token two ahead. A loss that runs, decreases and optimizes another objective."""

    name = "hf_shift_twice"

    def backward_window(self, model: nn.Module, window: Sequence[dict[str, torch.Tensor]]) -> float | None:
        def twice(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            once = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
            return logits[:, :-1], once[:, 1:]

        return _hf_window(model, window, twice)


@control(Target("parity", "uneven", batch_format=HF), "unexplained")
class HfNoShift:
    """Takes the unshifted labels as aligned: ``logits[:, t]`` against ``labels[:, t]``, the token at ``t`` itself,
    which position ``t`` already sees (the harness's aligned labels used in the hf convention)."""

    name = "hf_no_shift"

    def backward_window(self, model: nn.Module, window: Sequence[dict[str, torch.Tensor]]) -> float | None:
        return _hf_window(model, window, lambda logits, labels: (logits, labels))


@control(Target("parity", "uneven", batch_format=HF), "global_scale")
class HfCountBeforeShift:
    """The correct hf loop (sums, ``no_sync``, the shift once in the loss) whose count is taken *before* the shift:
    ``(labels != -100).sum()`` over the unshifted labels, as transformers' ``Trainer._get_num_items_in_batch``
    counted its ``num_items_in_batch`` for causal LM losses (fixed in huggingface/transformers#46204). Position 0 of
    a row without a prompt holds a real token (``labels = input_ids``) that the shift never makes a target, so the
    count is one too many per such row, and every weight is ``N / (N + rows without a prompt)``: a global scale that
    a loss curve never shows."""

    name = "hf_count_before_shift"

    def backward_window(self, model: nn.Module, window: Sequence[dict[str, torch.Tensor]]) -> float | None:
        local_count = sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in window)  # the mistake
        total = global_count(local_count)
        check_global_count(total)
        world, local = _world_size(), 0.0
        for i, batch in enumerate(window):
            with _sync_last(model, i, len(window)):
                logits = logits_of(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
                s = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
                (s * (world / total)).backward()
            local += float(s.detach())
        return global_sum(local) / total


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


@control(Target("parity", "uneven"), "double_counted")
class LastMicrobatchTwice:
    """Runs every microbatch inside ``no_sync()``, then runs the last one again outside it to get the one
    synchronization: the count of synchronizations is right, and the last microbatch's tokens count twice."""

    name = "last_microbatch_twice"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        with model.no_sync():  # type: ignore[operator]
            for mb in window:
                global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
        last = window[-1]
        global_token_loss(loss_sum(model(last.inputs), last.labels), total, world).backward()
        return None


WEIGHT_DECAY = 0.01
"""The decoupled weight decay the two weight-editing controls apply (times the harness's SGD rate, 0.1)."""


def _decay_weights(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 - 0.1 * WEIGHT_DECAY)


@control(Target("weights_unchanged", "uneven"), "weights_edited")
class WeightDecayAfterBackward:
    """The correct window, then decoupled weight decay applied in place (``p.mul_(1 - lr * wd)``), as a training
    step written as one function does before ``optimizer.step()``. The gradient is right; the weights the optimizer
    steps from are not the ones it was taken at, and the next window starts elsewhere."""

    name = "weight_decay_after_backward"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        accumulate(model, window, lambda s: global_token_loss(s, total, world))
        _decay_weights(model)
        return None


@control(Target("weights_unchanged", "uneven"), "weights_edited")
class WeightDecayBetweenMicrobatches:
    """Weight decay applied in place after every microbatch's backward (an accumulation loop that decays as if each
    microbatch were a step): every microbatch after the first is differentiated at other weights."""

    name = "weight_decay_between_microbatches"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        total, world = window_count(window), _world_size()
        for i, mb in enumerate(window):
            with _sync_last(model, i, len(window)):
                global_token_loss(loss_sum(logits_of(model(mb.inputs)), mb.labels), total, world).backward()
            _decay_weights(model)
        return None


mean_of_local_means = MeanOfLocalMeans()
extra_microbatch_division = ExtraMicrobatchDivision()
no_world_size_factor = NoWorldSizeFactor()
skip_backward_when_empty = SkipBackwardWhenEmpty()
local_count_guard = LocalCountGuard()
never_no_sync = NeverNoSync()
float32_loss = Float32Loss()
local_logged_loss = LocalLoggedLoss()

per_microbatch_mean = PerMicrobatchMean()
two_microbatch_loop = TwoMicrobatchLoop()
sync_keyed_to_first_microbatch = SyncKeyedToFirstMicrobatch()
count_from_one_microbatch = CountFromOneMicrobatch()
cached_count = CachedCount
"""A class, not an instance: its state lives on the object, and each rank builds its own (load_recipe builds it)."""
fixed_accumulation_steps = FixedAccumulationSteps()
first_microbatch_never_syncs = FirstMicrobatchNeverSyncs()
nan_on_empty_rank = NanOnEmptyRank()
nan_on_empty_microbatch = NanOnEmptyMicrobatch()
silent_empty_window = SilentEmptyWindow()
nan_gradients_then_raise = NanGradientsThenRaise()
python_random_shuffle = PythonRandomShuffle()
numpy_random_draw = NumpyRandomDraw()
torch_random_draw = TorchRandomDraw()
hf_shift_twice = HfShiftTwice()
hf_no_shift = HfNoShift()
hf_count_before_shift = HfCountBeforeShift()
per_sequence_mean = PerSequenceMean()
last_microbatch_twice = LastMicrobatchTwice()
weight_decay_after_backward = WeightDecayAfterBackward()
weight_decay_between_microbatches = WeightDecayBetweenMicrobatches()


CONTROLS: dict[str, Target] = targets()
"""Every negative control in this module (``harness.recipes:<name>``) and where the battery must reject it, derived
from the ``@control`` each class carries."""

NEGATIVE_CONTROLS = tuple(CONTROLS)

DIAGNOSES: dict[str, str | None] = diagnoses()
"""The signature the gradient diagnosis (:mod:`harness.battery.diagnose`) must give each control on its target: its
weights, read off the numbers. None where the run leaves no gradient to read (a desync; a window without tokens).
A control whose mistake is not in the gradient (a sync count, a random generator, the logged loss) reads
``correct``: the diagnosis never blames the weights for what another check catches."""

SCENARIO_CONTROLS: dict[str, str] = scenario_controls()
"""For each scenario but the base one (``uneven``), the control that only that scenario catches: it passes every
other scenario of the battery (``tests/distributed/test_negative_controls.py`` shows both)."""


