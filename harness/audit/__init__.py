"""The audit of a training loop the harness did not write: :func:`watch` records what the loop's model and optimizer
saw (:mod:`.watch`), and the record is judged as :class:`~harness.diagnosis.evidence.Evidence` by the same diagnosis
as the battery (:mod:`.evidence`). Today in one process, in code::

    with harness.audit.watch(windows=1) as audit:
        train()
    print(audit.verdict())
"""

from harness.audit.watch import Audit, watch

__all__ = ["Audit", "watch"]
