"""The diagnosis's reading of a constant normalizer that the ranks' average divides again.

Under ``--objective fixed_normalizer`` every token weighs ``1/C``, a constant the recipe declares (Dr. GRPO's batch
size x maximum completion length). A rank that divides its loss sum by ``C`` alone leaves DDP's (or FSDP2's) average
over the ``W`` ranks nothing to cancel: every token weighs ``1/(W C)``, 1/W of the declared objective. The weights'
fit reads that as a common scale; under this objective, a scale of exactly ``1/W`` is this mistake (verl #3741,
fixed by #5366's ``* dp_size``), named ``constant_averaged_over_ranks`` with its own fix.
"""

from __future__ import annotations

from harness.core import objectives as ob
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.fit import match_tolerance
from harness.diagnosis.signatures import Signature


def constant_reading(ev: Evidence, sig: Signature) -> Signature | None:
    """``constant_averaged_over_ranks`` where the declared objective is a constant normalizer and the weights read a
    common scale of ``1/W`` (``W`` the token group's size, the ranks the gradients are averaged over); None
    otherwise."""
    world = ev.mesh.token_ranks
    if ev.objective.name != ob.FIXED_NORMALIZER or sig.name != "global_scale" or sig.factor is None or world < 2:
        return None
    if abs(sig.factor * world - 1) > match_tolerance():
        return None
    c = ev.objective.normalizer
    return Signature("constant_averaged_over_ranks", f"every token weighs 1/(W * C), W={world} and the declared "
                     f"constant C={c:g}: each rank's loss sum was divided by C alone, and the gradients' average "
                     f"over the {world} ranks divides it by W again, so the gradient is 1/{world} of the declared "
                     "objective (a constant normalizer without the data-parallel factor: verl #3741, #5366)",
                     sig.factor)


__all__ = ["constant_reading"]
