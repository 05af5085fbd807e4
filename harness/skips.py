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


def two_gpus_missing() -> str:
    """Why the ``gpu2`` lane (two ranks, one CUDA device each, NCCL) cannot run here; "" when it can.

    The first thing missing, in the words a user acts on (``check-environment --dual`` can print it as it is).
    """
    found = cuda_devices()
    if found < 2:
        # NCCL refuses two ranks on one device, so one GPU is not enough even for two ranks.
        return f"needs 2 CUDA devices, found {found}"
    if not _nccl():
        return "needs torch.distributed with NCCL, this torch build has none"
    return ""


_WHY_NOT_TWO_GPUS = two_gpus_missing()
requires_two_gpus = pytest.mark.skipif(
    bool(_WHY_NOT_TWO_GPUS), reason=_WHY_NOT_TWO_GPUS or "two CUDA devices and NCCL are present"
)


def _one_gpu_with_nccl_missing() -> str:
    found = cuda_devices()
    if found < 1:
        return f"needs 1 CUDA device, found {found}"
    if not _nccl():
        return "needs torch.distributed with NCCL, this torch build has none"
    return ""


_WHY_NOT_ONE_GPU_WITH_NCCL = _one_gpu_with_nccl_missing()
requires_one_gpu_with_nccl = pytest.mark.skipif(
    bool(_WHY_NOT_ONE_GPU_WITH_NCCL), reason=_WHY_NOT_ONE_GPU_WITH_NCCL or "a CUDA device and NCCL are present"
)
"""For one rank training on CUDA: the trainer puts its model on the GPU only under a backend that includes NCCL."""
