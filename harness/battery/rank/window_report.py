"""What a rank says about each window when it has finished it: the phrase and the count of gradient synchronizations
it reports through :func:`harness.distributed.launcher.progress`.

Every rank must run the same collectives in a window: the count's all-reduce, then the one synchronization of the
last backward. A rank that skips its backward (an empty window, a guard on its own count) leaves its peers waiting in
the synchronization it skipped; whatever then ends the run (gloo's size mismatch killing a rank, the lockstep grace,
the deadline), the launcher compares these reports and names the window and the rank
(:mod:`harness.distributed.divergence`). So the phrase says what the rank did, in words a reader can act on:
"skipped the backward of window 3", not "window 3: done".
"""

from __future__ import annotations

import torch


class Passes:
    """Counts the model's forward passes, and the backward passes that reached its output, in the current window (a
    forward hook on the model puts a gradient hook on its output tensor)."""

    def __init__(self) -> None:
        self.forwards = 0
        self.backwards = 0
        self.hooked = 0
        """Forwards whose output tensor carried the hook (0 with outputs the hook cannot find: then unknown)."""

    def attach(self, model: torch.nn.Module) -> None:
        model.register_forward_hook(self._forward)

    def reset(self) -> None:
        self.forwards = self.backwards = self.hooked = 0

    def _forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.forwards += 1
        tensor = _output_tensor(output)
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            self.hooked += 1
            tensor.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        self.backwards += 1


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
    if syncs == 0:
        return f"ran no gradient synchronization in window {window} (its backward passes all skipped it)"
    return f"finished window {window} with {_syncs(syncs)}"


__all__ = ["Passes", "window_note"]
