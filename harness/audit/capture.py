"""The audit inside every process of a script launched by ``python -m harness audit`` (loaded by
:mod:`harness/audit/site/sitecustomize.py <harness.audit.site>` before the script's first line).

When :data:`DIR_ENV` names a folder, :func:`start` installs :func:`harness.audit.watcher.install`'s hooks and wrappers
for the whole process. At the ``optimizer.step()`` that ends the last audited window, each rank removes them and
sends its record to rank 0 through the script's own process group (``gather_object``: no file is shared, so the ranks
may sit on many nodes); rank 0 judges every rank's windows (:func:`harness.audit.evidence.judge`) and sends the
verdict back (``broadcast_object_list``); on every node, local rank 0 writes it to ``<folder>/verdict.json`` for the
command to print. Then every rank leaves with status 0, unless :data:`CONTINUE_ENV` says to go on (the script runs on
unwatched).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DIR_ENV = "HARNESS_AUDIT_DIR"
WINDOWS_ENV = "HARNESS_AUDIT_WINDOWS"
SKIP_ENV = "HARNESS_AUDIT_SKIP"
CONTINUE_ENV = "HARNESS_AUDIT_CONTINUE"
LABELS_ENV = "HARNESS_AUDIT_LABELS"
OBJECTIVE_ENV = "HARNESS_AUDIT_OBJECTIVE"
UNBALANCE_ENV = "HARNESS_AUDIT_UNBALANCE"
MAX_MB_ENV = "HARNESS_AUDIT_MAX_CAPTURE_MB"
MODEL_ENV = "HARNESS_AUDIT_MODEL"
VERDICT = "verdict.json"


def write_verdict(folder: Path, found: dict[str, Any], midway: Callable[[], None] | None = None) -> None:
    """Write ``found`` to ``<folder>/verdict.json`` whole or not at all: the command polls for the file and reads it as
    soon as it exists, so it is written under a temporary name and renamed over the final one (``midway()`` is called
    with half of it written, as a slow disk or a descheduled rank would leave it)."""
    data = json.dumps(found)
    tmp = folder / f".{VERDICT}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        if midway is not None:
            midway()
        f.write(data[len(data) // 2:])
    os.replace(tmp, folder / VERDICT)


def finish(audit: Any, folder: Path, handles: list[Any]) -> None:
    """The end of the audited windows on this rank: send, judge on rank 0, receive, write, leave."""
    from harness.audit.record import Record
    from harness.audit.watcher import uninstall

    uninstall(handles)
    audit.report_unbalance()

    def verdict_of(plain_records: list[Any]) -> dict[str, Any]:
        from harness.audit.evidence import judge

        try:  # whatever happens here, rank 0 still answers the others: no rank waits on it until the deadline
            others = [Record.from_plain(p) for p in plain_records[1:]]
            verdict = judge(audit, others, objective=os.environ.get(OBJECTIVE_ENV, "token_mean"),
                            labels=os.environ.get(LABELS_ENV, "auto"), model=os.environ.get(MODEL_ENV) or None)
            return {"passed": verdict.passed, "lines": list(verdict.lines)}
        except Exception as exc:
            return {"passed": False, "lines": [f"audit: not judged: judging the record failed: "
                                               f"{type(exc).__name__}: {exc}"]}

    from harness.audit.exchange import exchange

    found = exchange(audit, verdict_of)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        write_verdict(folder, found)
    if os.environ.get(CONTINUE_ENV) != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def start() -> None:
    """Install the audit for this process when :data:`DIR_ENV` is set (nothing otherwise)."""
    where = os.environ.get(DIR_ENV)
    if not where:
        return
    from harness.audit.watcher import Audit, install

    unbalance = os.environ.get(UNBALANCE_ENV)
    max_mb = os.environ.get(MAX_MB_ENV)
    audit = Audit(int(os.environ.get(WINDOWS_ENV, "2")), int(os.environ.get(SKIP_ENV, "0")),
                  unbalance=None if unbalance is None else int(unbalance),
                  max_capture_mb=None if max_mb is None else float(max_mb), rank=int(os.environ.get("RANK", "0")))
    handles: list[Any] = []

    def stepped() -> None:
        if audit.steps == audit.skip + audit.wanted:
            finish(audit, Path(where), handles)

    handles += install(audit, stepped)


__all__ = ["CONTINUE_ENV", "DIR_ENV", "LABELS_ENV", "MAX_MB_ENV", "MODEL_ENV", "OBJECTIVE_ENV", "SKIP_ENV",
           "UNBALANCE_ENV", "VERDICT", "WINDOWS_ENV", "finish", "start", "write_verdict"]
