"""Input checks of the public DSA functions: every failure names the argument, before any op
runs.

Metadata (types, shapes, dtypes, devices, Python scalars) is always checked.  Values are read
only outside torch.compile: ``cu_seqlens`` (from ``cu_seqlens_cpu`` when given, else one device
read) and an ``indices`` argument (one device read).  While torch.compile traces, the op bodies
check ``cu_seqlens`` and the index range on the host instead.
"""
from __future__ import annotations

import math

import torch

from .reference.layout import check_cu_seqlens_values, key_starts
from .reference.loss import REDUCTIONS

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _require_tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _float_tensor(x, name, dims: str, device):
    """``x`` is a bf16/fp16/fp32/fp64 tensor of ``len(dims.split())`` dims on ``device``."""
    _require_tensor(x, name)
    ndim = len(dims.split(","))
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape [{dims}], got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bf16, fp16, fp32 or fp64, got {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the device of the other inputs)")


def _same_tokens(x, name, T, ref_name):
    if x.shape[0] != T:
        raise ValueError(f"{name} has {x.shape[0]} tokens but {ref_name} has T={T}")


def _positive(shape, names, owner):
    for size, name in zip(shape, names):
        if size == 0:
            raise ValueError(f"{owner} has {name} = 0; head counts and head sizes must be positive")


def _python_int(value, name, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _python_float(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    # (Dynamo may hand a symbolic float here; its value is only checked eagerly.)
    if not torch.compiler.is_compiling() and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def check_index_inputs(q_idx, k_idx, w) -> tuple[int, torch.device]:
    """``q_idx [T, H_idx, D_idx]``, ``k_idx [T, D_idx]`` (one dtype), ``w [T, H_idx]``.
    Returns ``(T, device)``."""
    _float_tensor(q_idx, "q_idx", "T, H_idx, D_idx", None)
    device = q_idx.device
    _float_tensor(k_idx, "k_idx", "T, D_idx", device)
    _float_tensor(w, "w", "T, H_idx", device)
    T, H_idx, D_idx = q_idx.shape
    _positive((H_idx, D_idx), ("H_idx", "D_idx"), "q_idx")
    _same_tokens(k_idx, "k_idx", T, "q_idx")
    _same_tokens(w, "w", T, "q_idx")
    if k_idx.shape[1] != D_idx:
        raise ValueError(f"k_idx must have shape [T, D_idx] = [{T}, {D_idx}], got {tuple(k_idx.shape)}")
    if w.shape[1] != H_idx:
        raise ValueError(f"w must have shape [T, H_idx] = [{T}, {H_idx}], got {tuple(w.shape)}")
    if k_idx.dtype != q_idx.dtype:
        raise TypeError(f"k_idx has dtype {k_idx.dtype} but q_idx has {q_idx.dtype}; they must match")
    return T, device


def check_attention_inputs(q, kv, scale, d_v=None, device=None, tokens=None) -> tuple[int, int]:
    """``q [T, H, D_qk]``, ``kv [T, D_qk]`` of one dtype, finite scale, ``1 <= d_v <= D_qk``
    (unless None); ``tokens``: ``(T, name)`` of the indexer's inputs, which q must match.
    Returns ``(T, H)``."""
    _float_tensor(q, "q", "T, H, D_qk", device)
    if tokens is not None:
        _same_tokens(q, "q", *tokens)
    _float_tensor(kv, "kv", "T, D_qk", q.device)
    T, H, D = q.shape
    _positive((H, D), ("H", "D_qk"), "q")
    _same_tokens(kv, "kv", T, "q")
    if kv.shape[1] != D:
        raise ValueError(f"kv must have shape [T, D_qk] = [{T}, {D}] (one latent row per token), "
                         f"got {tuple(kv.shape)}")
    if kv.dtype != q.dtype:
        raise TypeError(f"kv has dtype {kv.dtype} but q has {q.dtype}; they must match")
    _python_float(scale, "scale")
    if d_v is None:
        return T, H
    _python_int(d_v, "d_v", 1)
    if d_v > D:
        raise ValueError(f"d_v (the value columns of kv) must be at most D_qk={D}, got {d_v}")
    return T, H


def check_topk(topk) -> None:
    _python_int(topk, "topk", 1)


def check_loss_options(coeff, reduction, coeff_name="coeff", reduction_name="reduction") -> None:
    _python_float(coeff, coeff_name)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{reduction_name} must be one of {REDUCTIONS}, got {reduction!r}")


def check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T: int, device) -> list | None:
    """Metadata always; values eagerly.  Returns the values read (None when not read)."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu was given without cu_seqlens")
        return None
    _require_tensor(cu_seqlens, "cu_seqlens")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the inputs are on {device}")
    if cu_seqlens_cpu is not None:
        _require_tensor(cu_seqlens_cpu, "cu_seqlens_cpu")
        if (cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.shape != cu_seqlens.shape
                or cu_seqlens_cpu.dtype not in (torch.int32, torch.int64)):
            raise ValueError("cu_seqlens_cpu must be an integer CPU tensor with the shape of cu_seqlens")
    if torch.compiler.is_compiling():
        return None
    values = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    check_cu_seqlens_values(values, T)
    return values


def check_indices(indices, T: int, device, cu_values: list | None, name="indices") -> int:
    """``indices [T, k]`` int32 on ``device``; eagerly also its values: each in ``[-1, T)``, a
    key its query may see (its own sequence, not after it), no key twice in a row.
    ``cu_values``: the values of ``cu_seqlens`` (None: one sequence).  Returns k."""
    _require_tensor(indices, name)
    if indices.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (positions in the packed token axis, -1 for an "
                        f"unused slot), got {indices.dtype}")
    if indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"{name} must have shape [T, k] with T={T}, got {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"{name} is on {indices.device} but the inputs are on {device}")
    if not torch.compiler.is_compiling() and indices.numel():
        _check_index_values(indices.detach().cpu().long(), T, cu_values, name)
    return indices.shape[1]


def _check_index_values(idx, T, cu_values, name):
    if int(idx.min()) < -1 or int(idx.max()) >= T:
        raise ValueError(f"{name} must lie in [-1, T={T}), got values in "
                         f"[{int(idx.min())}, {int(idx.max())}]")
    t = torch.arange(T)
    if cu_values is None:
        starts = torch.zeros(T, dtype=torch.int64)
    else:
        starts = key_starts(torch.tensor(cu_values), T, "cpu")
    valid = idx >= 0
    bad = valid & ((idx > t[:, None]) | (idx < starts[:, None]))
    if bad.any():
        row, slot = (int(i) for i in bad.nonzero()[0])
        s, lo = int(idx[row, slot]), int(starts[row])
        where = ("its token belongs to no sequence" if lo > row else
                 f"it may see keys {lo}..{row} of its own sequence")
        raise ValueError(f"{name}[{row}, {slot}] = {s} is not a key query {row} may see ({where}):"
                         f" an index may not point into the future or into another sequence")
    ordered = torch.sort(idx, dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if repeated.any():
        row, slot = (int(i) for i in repeated.nonzero()[0])
        raise ValueError(f"{name} row {row} selects key {int(ordered[row, slot])} twice; each key "
                         f"may appear once per row")


def check_scores(scores, indices_shape, device, name="scores") -> None:
    _require_tensor(scores, name)
    if scores.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bf16, fp16, fp32 or fp64, got {scores.dtype}")
    if tuple(scores.shape) != tuple(indices_shape):
        raise ValueError(f"{name} must have the shape of indices {tuple(indices_shape)}, got "
                         f"{tuple(scores.shape)}")
    if scores.device != device:
        raise ValueError(f"{name} is on {scores.device} but the inputs are on {device}")


def check_lse(lse, T, H, device, name="lse") -> None:
    _require_tensor(lse, name)
    if lse.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float tensor, got {lse.dtype}")
    if tuple(lse.shape) != (T, H):
        raise ValueError(f"{name} must have shape [T, H] = [{T}, {H}], got {tuple(lse.shape)}")
    if lse.device != device:
        raise ValueError(f"{name} is on {lse.device} but the inputs are on {device}")
