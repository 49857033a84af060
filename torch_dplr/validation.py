"""Input checks for the public functions: every failure names the argument, before any op runs.

Only metadata is read (shapes, dtypes, devices) except for ``cu_seqlens`` values, which are
read from ``cu_seqlens_cpu`` when given (no device sync) and skipped while torch.compile
traces (the ops re-check them on the host when they build their chunk layout).
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from .reference.layout import check_cu_seqlens_values

SUPPORTED_CHUNK_SIZES = (16, 32, 64)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _require_tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_inputs(tensors: Mapping[str, torch.Tensor], *, gate: str, value: str, scale,
                 initial_state, cu_seqlens, cu_seqlens_cpu, chunk_size=None,
                 lower_bound=None, initial_state_name="initial_state") -> None:
    """``tensors`` maps the caller's argument names to q, k, v, a, b, gk in that order.

    ``gate``/``value`` name the gate and value arguments among them.
    """
    if not _tensors_agree(tensors, gate, value):
        _check_tensors(tensors, gate, value)  # raises, naming the argument
    first = next(iter(tensors))
    ref = tensors[first]
    B, T, H, K = ref.shape
    V = tensors[value].shape[-1]
    if K == 0 or V == 0 or H == 0:
        raise ValueError(f"head count and head sizes must be positive, got H={H}, K={K}, V={V}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        # (Dynamo may hand a symbolic float here; its value is only checked eagerly.)
        if not torch.compiler.is_compiling() and not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    if chunk_size is not None and chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK_SIZES}, got {chunk_size!r}")
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
            raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
        if not lower_bound < 0:
            raise ValueError(f"lower_bound must be negative (the gate is a log-decay <= 0), got {lower_bound}")
    N = B
    if cu_seqlens is not None:
        N = _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, ref, first, B, T)
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu was given without cu_seqlens")
    if initial_state is not None:
        _require_tensor(initial_state, initial_state_name)
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(f"{initial_state_name} must have shape [N, H, K, V] = {(N, H, K, V)}, "
                             f"got {tuple(initial_state.shape)}")
        if not initial_state.dtype.is_floating_point:
            raise TypeError(f"{initial_state_name} must be floating point, got {initial_state.dtype}")
        if initial_state.device != ref.device:
            raise ValueError(f"{initial_state_name} is on {initial_state.device} but {first} is on {ref.device}")


def _tensors_agree(tensors: Mapping[str, torch.Tensor], gate: str, value: str) -> bool:
    """Whether :func:`_check_tensors` would pass, in one cheap pass: a per-token call runs
    this on every step, and its host time is not hidden behind the kernel.  Stricter never
    looser than the detailed checks (a false answer only sends the call to them)."""
    items = iter(tensors.items())
    _, ref = next(items)
    if not isinstance(ref, torch.Tensor):
        return False
    shape, dtype, device = ref.shape, ref.dtype, ref.device
    if len(shape) != 4 or dtype not in INPUT_DTYPES:
        return False
    for name, x in items:
        if not isinstance(x, torch.Tensor) or x.device != device:
            return False
        if name == value:
            if x.dim() != 4 or x.shape[:3] != shape[:3] or x.dtype != dtype:
                return False
        elif x.shape != shape:
            return False
        elif name == gate:
            if not x.dtype.is_floating_point:
                return False
        elif x.dtype != dtype:
            return False
    return True


def _check_tensors(tensors: Mapping[str, torch.Tensor], gate: str, value: str) -> None:
    """Every tensor argument's type, shape, dtype and device, in argument order: the first
    failure raises, naming its argument."""
    for name, x in tensors.items():
        _require_tensor(x, name)
    first = next(iter(tensors))
    ref = tensors[first]
    if ref.dim() != 4:
        raise ValueError(f"{first} must have shape [B, T, H, K], got {tuple(ref.shape)}")
    for name, x in tensors.items():
        if x.device != ref.device:
            raise ValueError(f"{name} is on {x.device} but {first} is on {ref.device}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if name == value:
            if x.dim() != 4 or x.shape[:3] != ref.shape[:3]:
                raise ValueError(f"{name} must have shape [B, T, H, V] = [{', '.join(map(str, ref.shape[:3]))}, V],"
                                 f" got {tuple(x.shape)}")
        elif x.shape != ref.shape:
            raise ValueError(f"{name} must have the shape of {first} {tuple(ref.shape)}, got {tuple(x.shape)}")
        if name != gate and x.dtype != ref.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but {first} has {ref.dtype}; "
                            f"all inputs but {gate} must share one dtype")
    if ref.dtype not in INPUT_DTYPES:
        raise TypeError(f"{first} must be bf16, fp16, fp32 or fp64, got {ref.dtype}")


def _check_cu_seqlens(cu, cu_cpu, ref, first, B, T) -> int:
    _require_tensor(cu, "cu_seqlens")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.device != ref.device:
        raise ValueError(f"cu_seqlens is on {cu.device} but {first} is on {ref.device}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (flatten the sequences), got B={B}")
    if cu_seqlens_cpu_given := cu_cpu is not None:
        _require_tensor(cu_cpu, "cu_seqlens_cpu")
        if cu_cpu.device.type != "cpu" or cu_cpu.shape != cu.shape or cu_cpu.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens_cpu must be an integer CPU tensor with the shape of cu_seqlens")
    if not torch.compiler.is_compiling():
        values = (cu_cpu if cu_seqlens_cpu_given else cu).tolist()
        check_cu_seqlens_values(tuple(values), T)
    return cu.shape[0] - 1
