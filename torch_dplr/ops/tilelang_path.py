"""Whether a CUDA call may run a TileLang kernel; otherwise the op keeps its PyTorch kernel.

Kernels are built for sm_90a (H200/H100) only, for the configurations of
:func:`kernels_apply`.  ``TORCH_DPLR_DISABLE_TILELANG=1`` forces the PyTorch kernels (for
debugging); it is read inside op bodies at run time, never while tracing.
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


def device_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` (``cuda`` without one: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (132 on the H200)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def tilelang_usable(device: torch.device) -> bool:
    if os.environ.get("TORCH_DPLR_DISABLE_TILELANG") == "1":
        return False
    return _device_ok(device_index(device))


KERNEL_DTYPES = (torch.bfloat16, torch.float16)
CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)


MAX_GRID_YZ = 65535  # CUDA's limit on grid y and z: kernels that put sequences there check it


def kernels_apply(x: torch.Tensor, chunk_size: int, K: int, V: int) -> bool:
    """Whether a call whose data tensor is ``x`` runs TileLang kernels: bf16/fp16 data,
    K = V in {64, 128}, chunk 16/32/64, a non-empty input on an sm_90 GPU.  Everything else
    (other head sizes, fp32/fp64 data, other GPUs) keeps the PyTorch kernels."""
    return (x.dtype in KERNEL_DTYPES and K == V and K in HEAD_DIMS and chunk_size in CHUNK_SIZES
            and x.numel() > 0 and tilelang_usable(x.device))
