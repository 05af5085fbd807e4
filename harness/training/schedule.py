"""The learning-rate schedule: linear warm-up, then linear decay to 0 at ``config.updates``.

Defined over the whole run: a stop at 50 does not shorten it, so the scheduler's position is state a resume restores.
"""

from __future__ import annotations


class WarmupLinearDecay:
    """LambdaLR factor: ``(s+1)/warmup`` during warm-up, then linear decay to 0 at ``updates``.

    A class rather than a lambda so that its definition travels with the scheduler's state (LambdaLR saves the
    ``__dict__`` of callable objects), and so that a resume that changed ``updates`` is visible in the state.
    """

    def __init__(self, warmup: int, updates: int) -> None:
        self.warmup = warmup
        self.updates = updates

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return max(0.0, (self.updates - step) / (self.updates - self.warmup))


__all__ = ["WarmupLinearDecay"]
