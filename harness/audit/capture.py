"""The audit inside every process of a script launched by ``python -m harness audit`` (loaded by
:mod:`harness/audit/site/sitecustomize.py <harness.audit.site>` before the script's first line).

When :data:`DIR_ENV` names a folder, :func:`start` installs :func:`harness.audit.watch.watch`'s hooks for the whole
process. At the ``optimizer.step()`` that ends the last audited window, each rank removes them, writes its record to
``<folder>/rank<R>.pt`` and meets the others (``torch.distributed.barrier``, when the script initialized a process
group); rank 0 then reads every rank's record, judges it (:func:`harness.audit.evidence.judge`) and writes
``verdict.json``; after a second barrier every rank leaves with status 0, unless :data:`CONTINUE_ENV` says to go on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from harness.audit.record import Call, Record, Window

DIR_ENV = "HARNESS_AUDIT_DIR"
WINDOWS_ENV = "HARNESS_AUDIT_WINDOWS"
SKIP_ENV = "HARNESS_AUDIT_SKIP"
CONTINUE_ENV = "HARNESS_AUDIT_CONTINUE"
VERDICT = "verdict.json"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def save(record: Record, path: Path) -> None:
    """``record``'s windows as plain tensors (the model stays with rank 0)."""
    torch.save({"steps": record.steps, "problems": record.problems, "skip": record.skip, "wanted": record.wanted,
                "windows": [{"start": w.start, "grad": w.grad, "syncs": w.syncs,
                             "calls": [(c.input_ids, c.labels, c.attention_mask) for c in w.calls]}
                            for w in record.windows]}, path)


def load(path: Path) -> Record:
    data = torch.load(path, weights_only=True)
    record = Record(data["wanted"], data["skip"])
    record.steps, record.problems = data["steps"], list(data["problems"])
    record.windows = [Window(w["start"], [Call(*c) for c in w["calls"]], w["grad"], w["syncs"])
                      for w in data["windows"]]
    return record


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _world() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1"))


def finish(record: Record, folder: Path, handles: list[Any]) -> None:
    """The end of the audited windows on this rank: write, meet, judge on rank 0, meet, leave."""
    for h in handles:
        h.remove()
    rank = _rank()
    save(record, folder / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        from harness.audit.evidence import judge

        try:  # whatever happens here, rank 0 still meets the others below: no rank waits on it until the deadline
            others = [load(folder / f"rank{r}.pt") for r in range(1, _world())]
            verdict = judge(record, others)
            found = {"passed": verdict.passed, "lines": list(verdict.lines)}
        except Exception as exc:
            found = {"passed": False, "lines": [f"audit: not judged: judging the record failed: "
                                                f"{type(exc).__name__}: {exc}"]}
        (folder / VERDICT).write_text(json.dumps(found))
    _barrier()
    if os.environ.get(CONTINUE_ENV) != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def start() -> None:
    """Install the audit for this process when :data:`DIR_ENV` is set (nothing otherwise)."""
    where = os.environ.get(DIR_ENV)
    if not where:
        return
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from harness.audit.watch import Audit

    audit = Audit(int(os.environ.get(WINDOWS_ENV, "2")), int(os.environ.get(SKIP_ENV, "0")))
    handles: list[Any] = []

    def step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        audit._step(optimizer, args, kwargs)
        if audit.steps == audit.skip + audit.wanted:
            finish(audit, Path(where), handles)

    handles += [register_module_forward_pre_hook(audit._pre),
                register_module_forward_hook(audit._post, with_kwargs=True),
                register_optimizer_step_pre_hook(step)]


__all__ = ["CONTINUE_ENV", "DIR_ENV", "SKIP_ENV", "VERDICT", "WINDOWS_ENV", "finish", "load", "save", "start"]
