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
requires_two_gpus = pytest.mark.skipif(
    cuda_devices() < 2 or not _nccl(),
    reason=f"needs 2 CUDA devices and NCCL, found {cuda_devices()} device(s) and NCCL "
    f"{'available' if _nccl() else 'missing'}",
)
