"""Readings of a window's gradient that need the run, not only the fitted weights: a gradient that is zero where the
reference's is not (named by whether the window synchronized, in the strategy's own words), and whether a failing
gradient's error is rounding-sized (the only case a remark about bf16 arithmetic is honest).

:mod:`harness.diagnosis.diagnose` calls :func:`zero_gradient` before fitting (the fit of a zero gradient reads every
weight 0, which no signature names), and :mod:`harness.battery.judge.checks` asks :func:`rounding_only` before it blames
bf16 arithmetic for a float32 run's failure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from harness.diagnosis.evidence import Evidence
from harness.diagnosis.fit import FLOAT32_RESIDUAL
from harness.diagnosis.signatures import Signature


def zero_gradient(ev: Evidence, window: int, rank: int, g: torch.Tensor, expected: torch.Tensor) -> Signature | None:
    """``not_synchronized`` when rank ``rank``'s gradient is zero, the reference's is not, and the window ran no
    synchronization (FSDP2 with the sync never re-enabled keeps its gradients unsharded and leaves every ``.grad``
    None); ``dropped`` when it synchronized a zero gradient (no backward reached the model). None otherwise."""
    if bool(g.ne(0).any()) or not bool(expected.ne(0).any()):
        return None
    assert ev.records is not None
    rec = ev.records[rank][window]
    blocks = tuple(f"rank {r}'s microbatch {m}" for r, mbs in enumerate(ev.windows[window])
                   for m, mb in enumerate(mbs) if mb.supervised)
    if rec.syncs == 0 and ev.world_size > 1:
        if ev.strategy == "fsdp2":
            how = ("every backward ran with model.set_requires_gradient_sync(False) and the last one was never "
                   "given set_requires_gradient_sync(True): FSDP2 then keeps the gradients unsharded inside the "
                   "module and leaves every sharded parameter's .grad None, so rank {rank}'s gradient is zero")
        else:
            how = ("the window ran no synchronization and rank {rank}'s gradient is zero: every backward ran inside "
                   "no_sync(), and the gradients were then cleared")
        return Signature("not_synchronized", how.format(rank=rank) + "; re-enable the synchronization for the "
                            "last microbatch's backward", 0.0, blocks=blocks)
    return Signature("dropped", f"rank {rank}'s gradient is zero although the window synchronized: every "
                        "microbatch contributed nothing (no backward reached the model's parameters, or the gradients "
                        "were zeroed after it)", 0.0, blocks=blocks)


BF16_UNIT = 2.0**-8
"""bfloat16's unit roundoff (8 significant bits): the relative error of one rounding. A loss taken on logits cast to
bfloat16 leaves the microbatch fit a residual of 8.5e-4 and weights within 1.4e-3 of right (``logits_in_bf16`` in
``tests/user_recipes/diagnosed.py``, uneven, W=2); tokens re-weighted by up to 7% leave 2.0e-2
(``position_weighted``)."""


def rounding_only(ratios: Sequence[float], residual: float, unit: float = BF16_UNIT) -> bool:
    """Whether the fitted weights leave only rounding-sized damage: a residual above float32 rounding (noise no
    re-weighting of the microbatches makes) and no larger than one rounding at ``unit``, with every weight within
    ``unit`` of right. A re-weighting of the microbatches leaves a float32-sized residual and shows in the weights;
    one inside the rows (tokens off by a few percent) leaves a residual larger than a rounding: neither is
    rounding."""
    live = [q for q in ratios if math.isfinite(q)]
    return bool(live) and FLOAT32_RESIDUAL < residual <= unit and all(abs(q - 1) <= unit for q in live)


def ranks_disagree(ev: Evidence, window: int, rank: int, names: Sequence[str], sizes: Sequence[int], atol: float,
                   rtol: float) -> Signature | None:
    """``not_reduced_over_group``: on a mesh of two dimensions or more, the synchronized gradients of some tensors
    differ between ``rank`` and another rank along one dimension, while every rank must hold the same full gradient:
    replicated parameters whose gradients were never all-reduced over that dimension (a hand-written tensor-parallel
    layer; under sequence parallelism, the norms, or a mixture-of-experts layer's router and experts run on each rank's
    tokens). None where every rank agrees or the mesh has one dimension."""
    mesh = ev.mesh
    if len(mesh.names) < 2 or ev.records is None:
        return None
    mine = ev.records[rank][window].grad
    if mine is None:
        return None
    for dim in mesh.names:
        for other in mesh.group(rank, [dim]):
            rec = ev.records[other][window] if window < len(ev.records[other]) else None
            if other == rank or rec is None or rec.grad is None:
                continue
            off, apart, worst = 0, [], 0.0
            for name, n in zip(names, sizes):
                a, b = mine[off : off + n].double(), rec.grad[off : off + n].double()
                off += n
                gap = float((a - b).abs().max()) if n else 0.0
                if gap > atol + rtol * float(b.abs().max() if n else 0.0):
                    apart.append(name)
                    worst = max(worst, gap)
            if apart:
                shown = ", ".join(apart[:6]) + (f" and {len(apart) - 6} more" if len(apart) > 6 else "")
                routers = [n for n in apart if "router" in n or ".gate." in n]
                where = (f"under sequence parallelism, a mixture-of-experts layer run on each {dim} rank's tokens "
                         f"with its router ({routers[0]}) and experts replicated, torchtitan #2387" if routers else
                         "under sequence parallelism, the norms' weights")
                how = ("hold them as DTensors replicated over it whose gradients are Partial (to_local(grad_placements="
                       "(Partial(),))), as torchtitan PR #2416 does" if routers else "let DTensor's SequenceParallel "
                       "do it")
                return Signature("not_reduced_over_group", f"the synchronized gradients of {shown} differ between "
                                 f"ranks {rank} and {other}, which differ along {dim} only (by up to {worst:.3e}): "
                                 f"replicated parameters whose gradients were never all-reduced over {dim}, so each "
                                 f"{dim} rank keeps its own partial sum (a hand-written {dim} layer; {where}): reduce "
                                 f"them over {dim}, or {how}", blocks=tuple(apart))
    return None


def ranks_apart(ev: Evidence, window: int) -> bool:
    """Whether the ranks started ``window`` from different weights (an earlier step differed between them)."""
    if ev.records is None:
        return False
    starts = [recs[window].params_before for recs in ev.records
              if window < len(recs) and recs[window].params_before is not None]
    return len(starts) > 1 and any(not torch.equal(starts[0], s) for s in starts[1:])


__all__ = ["BF16_UNIT", "ranks_apart", "ranks_disagree", "rounding_only", "zero_gradient"]
