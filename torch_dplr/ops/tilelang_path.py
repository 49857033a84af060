"""Whether a CUDA call may run a TileLang kernel; otherwise the op keeps its PyTorch kernel.

Kernels are built for sm_90a (H200/H100) only.  ``TORCH_DPLR_DISABLE_TILELANG=1`` forces the
PyTorch kernels (for debugging); it is read inside op bodies at run time, never while tracing.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> bool:
    try:
        import csrc_tl  # noqa: F401
        import tilelang  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(index) == (9, 0)


def tilelang_usable(device: torch.device) -> bool:
    if os.environ.get("TORCH_DPLR_DISABLE_TILELANG") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_ok(index)


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHUNK_SIZES = (16, 32, 64)


def head_dims_ok(*dims: int) -> bool:
    return all(d % 16 == 0 and 16 <= d <= 256 for d in dims)
