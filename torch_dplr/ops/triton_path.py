"""Whether a CUDA call may run a Triton kernel (``csrc_triton``); otherwise the op keeps its
PyTorch kernel.  Triton compiles for the GPU at hand (sm_80 and newer).
``TORCH_DPLR_DISABLE_TRITON=1`` forces the PyTorch kernels; it is read inside op bodies at run
time, never while tracing.
"""
from __future__ import annotations

import functools
import os

import torch

from .tilelang_path import MAX_GRID_YZ, device_index

# The per-token kernel computes in fp32 whatever the data dtype; fp64 stays on PyTorch.
PER_TOKEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The chunked sweep rounds to the data dtype where the staged pipeline does, and carries the
# fp32 state through products as bf16 hi/lo pairs.
SWEEP_DTYPES = (torch.bfloat16,)
SWEEP_HEAD_DIMS = (32, 64)
# Chunk of the sweep's saved states when an op recomputes them in its backward.
SWEEP_CHUNK = 64


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(index) >= (8, 0)


def triton_usable(device: torch.device) -> bool:
    if os.environ.get("TORCH_DPLR_DISABLE_TRITON") == "1":
        return False
    if device.type == "cpu":
        # Triton's interpreter runs the kernels on CPU tensors (the tests call the CUDA op
        # bodies there); without it a CPU tensor never reaches a kernel
        return os.environ.get("TRITON_INTERPRET") == "1"
    return device.type == "cuda" and _device_ok(device_index(device))


def _power_of_two(d: int) -> bool:
    return 16 <= d <= 128 and d & (d - 1) == 0


def per_token_kernel_applies(q: torch.Tensor, v: torch.Tensor, gk: torch.Tensor,
                             num_seqs: int) -> bool:
    """``csrc_triton.recurrent`` runs the call: bf16/fp16/fp32 data and gates, K and V powers
    of two in [16, 128], at most 65535 sequences (grid z), on a GPU where Triton runs."""
    return (q.dtype in PER_TOKEN_DTYPES and gk.dtype in PER_TOKEN_DTYPES
            and _power_of_two(q.shape[-1]) and _power_of_two(v.shape[-1])
            and num_seqs <= MAX_GRID_YZ and q.numel() > 0 and triton_usable(q.device))


def sweep_kernels_apply(q: torch.Tensor, v: torch.Tensor, gk: torch.Tensor,
                        num_seqs: int) -> bool:
    """``csrc_triton.chunk_fwd`` / ``chunk_bwd`` run the call: bf16 data, fp32 or bf16 gates,
    K = V in :data:`SWEEP_HEAD_DIMS`, at most 65535 sequences, on a GPU where Triton runs."""
    K, V = q.shape[-1], v.shape[-1]
    return (q.dtype in SWEEP_DTYPES and gk.dtype in (torch.float32, torch.bfloat16)
            and K == V and K in SWEEP_HEAD_DIMS and num_seqs <= MAX_GRID_YZ
            and q.numel() > 0 and triton_usable(q.device))
