"""Reusable skip markers, decided once in the parent process at collection (never by starting ranks to find out).

A GPU lane whose hardware is missing skips with the reason, unless ``HARNESS_REQUIRE_GPUS=N`` says this machine must
run every lane that needs at most N CUDA devices: such a lane then carries the ``required_gpus_missing`` marker
instead, and the plugin (``harness.testing.plugin``) fails each of its tests with the message. A GPU runner that sets
the variable cannot go green by skipping.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import pytest

REQUIRE_GPUS_ENV = "HARNESS_REQUIRE_GPUS"
"""Environment variable: a positive integer N; lanes needing at most N CUDA devices fail instead of skipping."""

REQUIRED_MARK = "required_gpus_missing"
"""Marker carrying the failure message of a lane that ``HARNESS_REQUIRE_GPUS`` requires and this machine cannot run."""

Verdict = Literal["run", "skip", "fail"]


# torch is imported where a lane is decided, not with the module: the plugin checks HARNESS_REQUIRE_GPUS at start-up
# in every pytest run, and a run without a GPU lane should not pay for torch.


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def required_gpus(value: str | None) -> int | None:
    """The N of ``HARNESS_REQUIRE_GPUS=N``; None when the variable is unset.

    Raises ValueError naming the variable, the value and the fix when ``value`` is not a positive integer (an empty
    value included: a CI variable that expanded to nothing must not turn the requirement off silently).
    """
    if value is None:
        return None
    if not re.fullmatch(r"[0-9]+", value.strip()) or int(value) < 1:
        msg = (
            f"{REQUIRE_GPUS_ENV}={value!r} is not a positive integer; set it to the number of CUDA devices this "
            f"machine must have (e.g. {REQUIRE_GPUS_ENV}=2 on a two-GPU runner), or unset it to let GPU lanes skip"
        )
        raise ValueError(msg)
    return int(value)


def gpus_with_nccl_missing(count: int) -> str:
    """Why ``count`` CUDA devices with NCCL are not available here; "" when they are.

    The first thing missing, in the words a user acts on (``check-environment --dual`` prints it as it is). NCCL
    refuses two ranks on one device, so one GPU is never enough for two NCCL ranks.
    """
    found = cuda_devices()
    if found < count:
        return f"needs {count} CUDA device{'s' if count > 1 else ''}, found {found}"
    if not _nccl():
        return "needs torch.distributed with NCCL, this torch build has none"
    return ""


def two_gpus_missing() -> str:
    """Why the ``gpu2`` lane (two ranks, one CUDA device each, NCCL) cannot run here; "" when it can."""
    return gpus_with_nccl_missing(2)


def lane_verdict(lane: str, needs: int, missing: str, required: int | None, found: int) -> tuple[Verdict, str]:
    """What a test of ``lane`` (needing ``needs`` CUDA devices) does here: ``("run", "")``, ``("skip", reason)`` or
    ``("fail", message)``.

    ``missing`` is why the lane cannot run ("" when it can), ``required`` the N of ``HARNESS_REQUIRE_GPUS`` (None:
    unset), ``found`` the CUDA devices this machine has. A lane fails only when it cannot run and needs at most N
    devices; a lane needing more than N still skips with its reason.
    """
    if not missing:
        return "run", ""
    if required is None or needs > required:
        return "skip", missing
    devices = f"{found} CUDA device{'' if found == 1 else 's'}"
    what = f"this machine has {devices}" if found < needs else f"the lane {missing}"
    message = (f"{REQUIRE_GPUS_ENV}={required} but {what}: the {lane} lane cannot run here "
               f"(unset {REQUIRE_GPUS_ENV} to skip instead)")
    return "fail", message


def _lane(lane: str, needs: int, missing: str) -> pytest.MarkDecorator:
    """The marker for a test of ``lane``: skip with the reason, fail (``HARNESS_REQUIRE_GPUS``), or nothing to do."""
    try:
        verdict, why = lane_verdict(lane, needs, missing, required_gpus(os.environ.get(REQUIRE_GPUS_ENV)),
                                    cuda_devices())
    except ValueError as exc:  # the plugin refuses a bad value at start-up; without it, fail rather than skip
        verdict, why = "fail", str(exc)
    if verdict == "fail":
        return getattr(pytest.mark, REQUIRED_MARK)(why)
    return pytest.mark.skipif(verdict == "skip", reason=why or "present")


_LANES: dict[str, Callable[[], pytest.MarkDecorator]] = {
    "requires_cuda": lambda: _lane(
        "gpu", 1, "" if cuda_devices() >= 1 else f"needs 1 CUDA device, found {cuda_devices()}"),
    "requires_two_gpus": lambda: _lane("gpu2", 2, two_gpus_missing()),
    "requires_one_gpu_with_nccl": lambda: _lane("gpu", 1, gpus_with_nccl_missing(1)),
}
"""The lane markers (``from harness.testing.skips import requires_cuda``), each decided on first import of its name
(PEP 562): the plugin imports this module in every pytest run, and only a GPU test module needs torch to ask."""

if TYPE_CHECKING:
    requires_cuda: pytest.MarkDecorator
    requires_two_gpus: pytest.MarkDecorator
    requires_one_gpu_with_nccl: pytest.MarkDecorator


def __getattr__(name: str) -> pytest.MarkDecorator:
    make = _LANES.get(name)
    if make is None:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    mark = globals()[name] = make()
    return mark
