"""What a torchrun worker of the harness does around its work: the backend torchrun's ranks can share, and how it
leaves.

Both torchrun entry points use it: the trainer (``python -m harness.train``, :mod:`harness.training.torchrun`) and the
battery (``python -m harness.battery.dist``). A worker leaves through :func:`exit_worker`: the function's status, its
streams flushed, then ``os._exit``, skipping the interpreter's teardown, in which gloo's and DDP's threads can abort
the worker ("terminate called without an active exception", SIGABRT) after its work was done; an aborted worker makes
torchrun's other agents wait in their exit barrier. The function itself destroys its process group before it returns.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch
import torch.distributed as dist


def default_backend(local_world_size: int) -> str:
    """NCCL when every local rank has a CUDA device of its own (NCCL refuses two ranks on one GPU), else gloo."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def exit_status(exc: SystemExit) -> int:
    """The exit status the interpreter gives ``SystemExit(code)``, printing a non-integer code to stderr as it does."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def exit_worker(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> NoReturn:
    """Run ``main(argv)`` and end the process with its status through ``os._exit``, never the interpreter's teardown.

    A ``SystemExit`` keeps its status (and its message on stderr); any other exception prints its traceback and exits
    1, so torchrun reports the failed rank. Never call this in-process: it ends the calling process.
    """
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exit_status(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more can be written
            stream.flush()
    os._exit(code)


__all__ = ["default_backend", "exit_status", "exit_worker"]
