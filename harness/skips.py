"""Reusable skip markers, decided once in the parent process at collection (never by starting ranks to find out)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl() -> bool:
    return dist.is_available() and dist.is_nccl_available()


requires_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
)
requires_cuda = pytest.mark.skipif(cuda_devices() < 1, reason=f"needs 1 CUDA device, found {cuda_devices()}")


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


def _skip_unless(missing: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(bool(missing), reason=missing or "present")


requires_two_gpus = _skip_unless(two_gpus_missing())
requires_one_gpu_with_nccl = _skip_unless(gpus_with_nccl_missing(1))
