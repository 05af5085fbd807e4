"""The audit of a training loop the harness did not write: :func:`watch` records what the loop's model and optimizer
saw (:mod:`.watcher`), and the record is judged as :class:`~harness.diagnosis.evidence.Evidence` by the same diagnosis
as the battery (:mod:`.evidence`). In code::

    with harness.audit.watch(windows=1) as audit:
        train()
    print(audit.verdict())

and on a script, unchanged: ``python -m harness audit -- torchrun --nproc-per-node 2 train.py`` (:mod:`.capture`).
"""

from typing import Any

__all__ = ["Audit", "watch"]


def __getattr__(name: str) -> Any:  # torch is imported with the watch, not with the package's pure-Python options
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("harness.audit.watcher"), name)
    raise AttributeError(name)
