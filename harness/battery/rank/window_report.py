"""What a rank says about each window when it has finished it: the phrase and the count of gradient synchronizations
it reports through :func:`harness.distributed.launcher.progress`.

Every rank must run the same collectives in a window: the count's all-reduce, then the one synchronization of the
last backward. A rank that skips its backward (an empty window, a guard on its own count) leaves its peers waiting in
the synchronization it skipped; whatever then ends the run (gloo's size mismatch killing a rank, the lockstep grace,
the deadline), the launcher compares these reports and names the window and the rank
(:mod:`harness.distributed.divergence`). So the phrase says what the rank did, in words a reader can act on:
"skipped the backward of window 3", not "window 3: done".

A rank also reports from inside the window, at each forward and backward (``progress(..., finished=False)``), how
many gradient synchronizations it has begun: a forward that prepared one (DDP outside ``no_sync()``) whose backward
then ran. A rank that skips the backward of its last microbatch and goes on to another collective (the logged loss's
all-reduce) dies there in gloo's size check, or under NCCL's watchdog, before any rank has finished the window; these
reports still tell the ranks apart: "skipped the backward of window 0 (microbatch 1): its DDP all-reduce never ran".
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

Report = Callable[[int, str, "int | None"], None]
"""``(window, note, synchronizations begun)``: where a rank's reports from inside a window go."""


class Passes:
    """Counts the model's forward passes, and the backward passes that reached its output, in the current window (a
    forward hook on the model puts a gradient hook on its output tensor); with :meth:`count_syncs`, which forwards
    prepared a gradient synchronization and whether their backward ran, reported at each pass."""

    def __init__(self, report: Report | None = None) -> None:
        self.forwards = 0
        self.backwards = 0
        self.hooked = 0
        """Forwards whose output tensor carried the hook (0 with outputs the hook cannot find: then unknown)."""
        self.report = report
        self.armed: Callable[[], bool] | None = None
        """Whether a forward run now prepares a gradient synchronization for its backward (None: not known)."""
        self.sync = "gradient synchronization"
        self.window = 0
        self.microbatches = 0
        self.arms: list[bool] = []
        """Per forward of the window: it prepared a gradient synchronization (and its output carried the hook)."""
        self.ran: list[bool] = []
        """Per forward of the window: its backward reached the output."""
        self.unknown = False
        """A forward prepared a synchronization but its output carried no hook: whether its backward ran is unknown."""
        self.last: tuple[str, int] | None = None

    def attach(self, model: torch.nn.Module) -> None:
        model.register_forward_hook(self._forward)

    def count_syncs(self, armed: Callable[[], bool], sync: str) -> None:
        """Read ``armed()`` at each forward (DDP: outside ``no_sync()``, with gradients on); ``sync`` names the
        collective such a forward's backward begins (``"DDP all-reduce"``)."""
        self.armed, self.sync = armed, sync

    def reset(self, window: int = 0, microbatches: int = 0) -> None:
        self.forwards = self.backwards = self.hooked = 0
        self.window, self.microbatches = window, microbatches
        self.arms, self.ran, self.unknown, self.last = [], [], False, None

    @property
    def begun(self) -> int | None:
        """The gradient synchronizations begun in the window (None: not counted)."""
        if self.armed is None or self.unknown:
            return None
        return sum(a and r for a, r in zip(self.arms, self.ran))

    def skipped_sync(self) -> int | None:
        """The first forward that prepared a gradient synchronization and whose backward did not run."""
        return next((i for i, (a, r) in enumerate(zip(self.arms, self.ran)) if a and not r), None)

    def where(self, i: int) -> str:
        """Forward ``i`` of the window, as its microbatch while the recipe runs one forward per microbatch."""
        return f"microbatch {i}" if self.forwards <= self.microbatches else f"its forward {i + 1} in the window"

    def so_far(self) -> str:
        """What the rank has done in the window so far, as a phrase naming the synchronization it skipped."""
        k, i = self.window, self.skipped_sync()
        if i is not None:
            return f"skipped the backward of window {k} ({self.where(i)}): its {self.sync} never ran"
        if self.last is not None and self.last[0] == "backward" and self.arms[self.last[1]]:
            return f"ran the backward of window {k} ({self.where(self.last[1])}), which began the {self.sync}"
        return (f"was in window {k} after {self.forwards} forward(s) and {self.backwards} backward(s), "
                f"{self.begun} {self.sync}(s) begun")

    def _changed(self) -> None:
        if self.report is not None and self.armed is not None:
            self.report(self.window, self.so_far(), self.begun)

    def _forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        index = self.forwards
        self.forwards += 1
        armed = self.armed is not None and self.armed()
        tensor = _output_tensor(output)
        hooked = False
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            hooked = True
            self.hooked += 1
            tensor.register_hook(partial(self._backward, self.window, index))
        self.unknown |= armed and not hooked
        self.arms.append(armed and hooked)
        self.ran.append(False)
        self.last = ("forward", index)
        self._changed()

    def _backward(self, window: int, index: int, grad: torch.Tensor) -> None:
        self.backwards += 1
        if window == self.window and index < len(self.ran):  # not a graph kept from an earlier window
            self.ran[index] = True
            self.last = ("backward", index)
        self._changed()


def _output_tensor(output: object) -> object:
    """The logits of a forward's output: the tensor itself, an output object's ``logits``, or the first tensor of a
    tuple or mapping."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _syncs(n: int) -> str:
    return "no gradient synchronization" if n == 0 else f"{n} gradient synchronization{'s' if n != 1 else ''}"


def window_note(window: int, syncs: int, passes: Passes, grads_left: str, error: str | None = None) -> str:
    """The phrase a rank reports for ``window``: how it ended the window and with how many synchronizations."""
    if error is not None:
        return f"refused window {window} ({error}) with {_syncs(syncs)}"
    skipped = passes.backwards == 0 if passes.hooked else grads_left == "none"
    if syncs == 0 and skipped:
        what = "the forward and backward" if passes.forwards == 0 else "the backward"
        return f"skipped {what} of window {window} ({_syncs(0)})"
    missed = passes.skipped_sync()
    if syncs == 0 and missed is not None:
        return f"skipped the backward of window {window} ({passes.where(missed)}; {_syncs(0)})"
    if syncs == 0:
        return f"ran no gradient synchronization in window {window} (its backward passes all skipped it)"
    return f"finished window {window} with {_syncs(syncs)}"


__all__ = ["Passes", "window_note"]
