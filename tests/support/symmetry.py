"""Rank symmetry: every rank takes the same branches around collectives, and what happens when one does not.

Seeds 003 and 004: one rank skips a batch (an empty window, a diverging loss) and misses a collective its peers
enter. It shows in three ways, each shown by a test in ``tests/distributed/test_symmetry.py``, and this module has a
rank body for each:

* **a hang**: the peers wait in the collective the rank skipped, until the process-group timeout (which the launcher
  sets below its deadline) turns it into an error naming the stuck rank, with the stack it was stuck in;
* **a mismatch**: the skipping rank's *next* collective has another size; both ranks wait, and fail the same way;
* **silently paired collectives**: the next collective has the *same* size (a metrics tensor as long as a gradient
  bucket) and gloo pairs it with the peer's gradient all-reduce: no error, wrong numbers on both ranks. Only a check
  that compares ranks finds it: :func:`ranks_agree_by_checksum` all-gathers a checksum of every rank's gradients.

The fix is a decision every rank takes together: :func:`agreed_max` all-reduces with MAX, so every rank compares the
same number with the threshold and every rank skips, or none does (seed 004's ``p2_max_loss.py``).

The module also holds a recipe for windows with *different numbers of microbatches per rank* through ``Join``
(outside the recipe contract, which keeps microbatch counts equal), with the divisor made explicit; see
:class:`JoinTokenMean`, and its negative controls. Test code, not the product's: ranks import it as
``support.symmetry`` (``tests/`` on ``sys.path``), and the Join recipes are named ``support.symmetry:<name>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.core.loss import check_global_count, count_device, global_count, global_token_loss, loss_sum
from harness.core.microbatch import Microbatch

# --- A small DDP model for the rank bodies --------------------------------------------------------------------------

FEATURES = 8
"""The probe model is one ``FEATURES x FEATURES`` linear layer: 72 parameters, so DDP reduces one bucket of 72."""

BUCKET_NUMEL = FEATURES * FEATURES + FEATURES


def _probe_model() -> DDP:
    # A private generator: the weights are the same on every rank without touching the global RNG state.
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(FEATURES, FEATURES)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.1)
        layer.bias.zero_()
    return DDP(layer)


def _probe_batch(rank: int) -> torch.Tensor:
    return torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(100 + rank))


# --- The agreed decision ----------------------------------------------------------------------------------------------


def agreed_max(value: float) -> float:
    """All-reduce ``value`` with MAX: every rank gets the largest value of any rank (the identity outside a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return float(value)
    t = torch.tensor(float(value), dtype=torch.float64, device=count_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def should_skip(local_loss: float, threshold: float) -> bool:
    """Skip the step when *any* rank's loss exceeds ``threshold``: one decision, the same on every rank.

    Every rank must call it, also a rank whose own loss is fine: the MAX is a collective.
    """
    return agreed_max(local_loss) > threshold


def local_should_skip(local_loss: float, threshold: float) -> bool:
    """NEGATIVE CONTROL: each rank decides from its own loss; ranks disagree as soon as one loss diverges."""
    return local_loss > threshold


def skip_step_body(local_losses: Sequence[float], threshold: float, agreed: bool = True) -> dict[str, Any]:
    """Rank body: rank r has loss ``local_losses[r]``; the step is skipped when the decision says so, otherwise
    every rank runs a DDP forward and backward. ``agreed=False`` uses :func:`local_should_skip` (the control)."""
    rank = dist.get_rank()
    local = float(local_losses[rank])
    decide = should_skip if agreed else local_should_skip
    skip = decide(local, threshold)
    model = _probe_model()
    if not skip:
        model(_probe_batch(rank)).sum().backward()  # DDP's gradient all-reduce: a collective on every rank
    agree = ranks_agree_by_checksum(model)
    del model
    return {"rank": rank, "local": local, "skip": skip, "ranks_agree": agree}


# --- A skipped collective, and the check that finds it when nothing fails ---------------------------------------------

SKIP_MODES = ("hang", "mismatch", "paired")
"""What the rank that skipped its backward does next: ``hang`` nothing but wait for the others (a barrier);
``mismatch`` an all-reduce of 3 numbers; ``paired`` an all-reduce of exactly one bucket's size."""


def grad_checksum(model: nn.Module) -> torch.Tensor:
    """``[sum, sum of squares]`` of this rank's gradients in float64 (zeros where ``.grad`` is None)."""
    params = list(getattr(model, "module", model).parameters())
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double() for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    return torch.stack([flat.sum(), (flat * flat).sum()])


def ranks_agree_by_checksum(model: nn.Module) -> bool:
    """All-gather every rank's :func:`grad_checksum`: True when every rank holds the same gradients.

    A collective itself, so every rank must call it at the same point. After a synchronized step the gradients are
    bitwise equal on every rank (the same all-reduce result), so equality is exact, not within a tolerance.
    """
    mine = grad_checksum(model).to(count_device())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def skipped_backward_body(skipper: int, mode: str) -> dict[str, Any]:
    """Rank ``skipper`` runs its forward but skips its backward (an "empty batch" branch), then does what ``mode``
    says; every other rank runs forward and backward. Every rank then compares gradient checksums."""
    if mode not in SKIP_MODES:
        msg = f"mode={mode!r} must be one of {SKIP_MODES}"
        raise ValueError(msg)
    rank = dist.get_rank()
    model = _probe_model()
    out = model(_probe_batch(rank)).sum()
    if rank != skipper:
        out.backward()  # enters DDP's all-reduce of one bucket of BUCKET_NUMEL numbers
    elif mode == "mismatch":
        dist.all_reduce(torch.zeros(3))  # e.g. its metrics: another size than the bucket it skipped
    elif mode == "paired":
        dist.all_reduce(torch.zeros(BUCKET_NUMEL))  # the same size: gloo pairs it with the peer's bucket
    else:
        dist.barrier()  # "wait for the others": a barrier never completes a peer's all-reduce
    agree = ranks_agree_by_checksum(model)
    del model
    return {"rank": rank, "ranks_agree": agree}


# --- Join: different numbers of microbatches per rank ---------------------------------------------------------------


class JoinTokenMean:
    """The global token mean over windows with *different numbers of microbatches per rank*, through ``Join``.

    What ``Join`` does to the intended average, and how this recipe keeps it:

    * A rank that runs out of microbatches *joins*: for every later forward/backward of the other ranks, DDP's join
      hook shadows DDP's own collectives, contributing a **zero** gradient to each bucket all-reduce.
    * The all-reduce still divides by the **initial world size** W (the harness's comm hook divides by
      ``dist.get_world_size()``; DDP's default hook does too with ``divide_by_initial_world_size=True``). So a
      microbatch run while k ranks have joined is averaged over W ranks, not over W - k: each microbatch's
      gradient enters as ``(1/W) * g_mb``, whatever rank and iteration it ran in.
    * Hence the divisor, made explicit: each rank backpropagates ``W * S_mb / N`` per microbatch, with ``N`` the
      global supervised count of the whole window. The ``W`` cancels the ``1/W`` above and the sum over every
      microbatch of every rank is ``(sum of all S) / N``: the global token mean, unchanged by Join.
    * ``N`` is all-reduced **before** entering the join. ``Join`` shadows only the collectives of the
      ``Joinable`` objects it was given (DDP's); a recipe's own count all-reduce inside the join has no shadow on
      a joined rank and pairs with a DDP collective or aborts (:class:`JoinLoggedLossInside`, shown in
      ``test_symmetry.py``).
    * Every microbatch synchronizes (no ``no_sync``): under Join a rank's "last microbatch" is not the same
      iteration on every rank, and a rank synchronizing while its peer does not is a skipped collective.
    * DDP all-reduces the whole ``.grad`` buffer, *accumulated* gradient included. Without Join that is harmless
      (every rank holds the same earlier average, and the average of ``prev + g_r`` is ``prev + mean g_r``); with a
      joined rank contributing zeros it halves (at W = 2) everything accumulated so far, every iteration
      (:class:`JoinAccumulatingInGrad`). So each microbatch's synchronized gradient is taken out of ``.grad``
      and summed in a private accumulator, which becomes ``.grad`` at the end.
    * A rank that joined early misses the gradient all-reduces after it joined: its own sum is partial. After the
      join every rank is in step again, so the sums are broadcast from the rank with the most microbatches (the last
      to join, which saw every all-reduce; :class:`JoinWithoutBroadcast` leaves this out).
    """

    name = "join_token_mean"
    accumulate_privately = True
    broadcast_from_last_joiner = True

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        world = dist.get_world_size()
        # Both numbers are collectives: taken before the join, on every rank, in the same order.
        total = global_count(sum(mb.supervised for mb in window))
        check_global_count(total)
        last = _last_joiner(len(window))
        params = list(model.parameters())
        acc = [torch.zeros_like(p) for p in params]
        with Join([model]):  # type: ignore[list-item]
            for mb in window:
                global_token_loss(loss_sum(model(mb.inputs), mb.labels), total, world).backward()
                if self.accumulate_privately:
                    for a, p in zip(acc, params):
                        if p.grad is not None:
                            a.add_(p.grad)
                            p.grad = None  # the next all-reduce then carries this microbatch's gradient only
        if self.accumulate_privately:
            for a, p in zip(acc, params):
                p.grad = a
        if self.broadcast_from_last_joiner:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.broadcast(p.grad, src=last)
        return None


class JoinAccumulatingInGrad(JoinTokenMean):
    """NEGATIVE CONTROL: :class:`JoinTokenMean` accumulating in ``.grad`` as usual. Each synchronized microbatch
    all-reduces the accumulated buffer, and a joined rank's zeros shrink the earlier microbatches' share."""

    name = "join_accumulating_in_grad"
    accumulate_privately = False


class JoinWithoutBroadcast(JoinTokenMean):
    """NEGATIVE CONTROL: :class:`JoinTokenMean` without the final broadcast: the rank that joined early keeps only
    the gradient all-reduces it took part in, so its ``.grad`` differs from the global token mean's."""

    name = "join_without_broadcast"
    broadcast_from_last_joiner = False


class JoinLoggedLossInside:
    """NEGATIVE CONTROL: the right scaling, but it logs the loss with its own all-reduce *inside* the join. A rank
    that has run out of microbatches reaches that all-reduce while its peers are still in DDP's collectives, which
    Join shadows and this one it does not: a mismatch (or a silent pairing), never the right gradient."""

    name = "join_logged_loss_inside"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        world = dist.get_world_size()
        total = global_count(sum(mb.supervised for mb in window))
        check_global_count(total)
        with Join([model]):  # type: ignore[list-item]
            logged = 0.0
            for mb in window:
                s = loss_sum(model(mb.inputs), mb.labels)
                global_token_loss(s, total, world).backward()
                logged += float(s.detach())
            t = torch.tensor(logged, dtype=torch.float64, device=count_device())
            dist.all_reduce(t)  # not a Joinable's collective: nothing shadows it on a joined rank
        return float(t) / total


class JoinLocalMeans:
    """NEGATIVE CONTROL: each microbatch backpropagates its own token mean under Join. DDP divides every
    microbatch's all-reduce by the initial W, so the result weights microbatches, not tokens, and is W times too
    small for every iteration a rank sat out (joined ranks add zeros, still counted in the divisor)."""

    name = "join_local_means"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        with Join([model]):  # type: ignore[list-item]
            for mb in window:
                (loss_sum(model(mb.inputs), mb.labels) / max(mb.supervised, 1)).backward()
        return None


def _last_joiner(microbatches: int) -> int:
    """The rank with the most microbatches (the highest such rank on a tie): it took part in every all-reduce."""
    t = torch.tensor([microbatches, dist.get_rank()], dtype=torch.int64, device=count_device())
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return int(max(everyone, key=lambda x: (int(x[0]), int(x[1])))[1])


join_token_mean = JoinTokenMean()
join_accumulating_in_grad = JoinAccumulatingInGrad()
join_without_broadcast = JoinWithoutBroadcast()
join_logged_loss_inside = JoinLoggedLossInside()
join_local_means = JoinLocalMeans()


__all__ = [
    "BUCKET_NUMEL",
    "SKIP_MODES",
    "JoinAccumulatingInGrad",
    "JoinLocalMeans",
    "JoinLoggedLossInside",
    "JoinTokenMean",
    "JoinWithoutBroadcast",
    "agreed_max",
    "grad_checksum",
    "join_accumulating_in_grad",
    "join_local_means",
    "join_logged_loss_inside",
    "join_token_mean",
    "join_without_broadcast",
    "local_should_skip",
    "ranks_agree_by_checksum",
    "should_skip",
    "skip_step_body",
    "skipped_backward_body",
]
