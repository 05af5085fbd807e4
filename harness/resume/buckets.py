"""DDP's gradient buckets kept in the layout they are built with, so that a fresh wrapper sums like an old one.

Why: ``DistributedDataParallel`` builds its buckets from the parameters' definition order (under its defaults, one
bucket of every parameter) and, after the first backward, rebuilds them once in the order the gradients became
ready. The all-reduce of a bucket runs over its flat buffer, and gloo's (and NCCL's) ring splits that buffer into
segments that start their sum at different ranks: where a gradient lies in the buffer decides the order in which the
W ranks' contributions are added. At W = 2 the order cannot matter (a + b == b + a, bitwise); at W >= 3 it does
((a + b) + c != a + (b + c) in the last bit). A resumed run builds a new wrapper, so its first step after the resume
sums in the construction layout while the run that never stopped sums in the rebuilt one: the weights then differ by
an ulp or so (measured in docs/resume.md: 3.0e-8 in float32 at W = 3 and 4, exactly 0 at W = 2, for a model
re-wrapped once at step 13 of 20), and a correct loop would be blamed for torch's reduction order.

The battery therefore keeps every DDP module a rank builds in its construction layout (no rebuild): the continuous
run and each resumed run then reduce every step alike. A rebuild changes which gradients share a bucket and the
order of the sum, never which gradients are summed, so nothing a resume must restore is hidden by it. It is installed
in the battery's ranks only (before the user's factory runs, so it covers a DDP the user's loop builds itself), and
it is named among the settings the report lists. ``find_unused_parameters=True`` never rebuilds, so such a loop is
unchanged by it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

SETTING = "DDP buckets kept in their construction layout (no rebuild after a wrapper's first step)"
"""How :data:`~harness.resume.generators.DETERMINISTIC_SETTINGS` names this in the battery's report."""

_ORIGINAL: list[Any] = []


def freeze_ddp_buckets() -> None:
    """From now on in this process, every ``DistributedDataParallel`` keeps the buckets it is built with.

    DDP builds its reducer as ``torch.distributed.Reducer(...)`` and asks it to rebuild before a forward
    (``reducer._rebuild_buckets()``, from Python); a subclass that declines is a reducer in every other respect.
    Idempotent."""
    if _ORIGINAL:
        return
    base = dist.Reducer
    _ORIGINAL.append(base)

    class ConstructionLayoutReducer(base):  # type: ignore[misc,valid-type]
        """A reducer whose buckets stay as DDP built them (see the module's docstring)."""

        def _rebuild_buckets(self) -> bool:
            return False

    dist.Reducer = ConstructionLayoutReducer  # type: ignore[misc]


def thaw_ddp_buckets() -> None:
    """Undo :func:`freeze_ddp_buckets` (tests that show what the freeze removes)."""
    if _ORIGINAL:
        dist.Reducer = _ORIGINAL.pop()  # type: ignore[misc]


__all__ = ["SETTING", "freeze_ddp_buckets", "thaw_ddp_buckets"]
