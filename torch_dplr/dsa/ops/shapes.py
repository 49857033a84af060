"""One shape function per ``dsa`` op: its fake and its kernels allocate through it.

Each returns a tuple of ``(shape, dtype)``; only shapes, dtypes and Python scalars are read,
so they run on FakeTensors and SymInts alike.
"""
from __future__ import annotations

import torch

INDEX_DTYPE = torch.int32


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64, everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _same(*tensors):
    return tuple((tuple(x.shape), x.dtype) for x in tensors)


def indexer_topk_shapes(q_idx, topk):
    """indices ``[T, topk]`` int32."""
    return (((q_idx.shape[0], topk), INDEX_DTYPE),)


def indexer_fwd_shapes(q_idx, indices):
    """scores ``[T, k]`` in the accumulation dtype of ``q_idx``."""
    return ((tuple(indices.shape), acc_dtype(q_idx.dtype)),)


def indexer_bwd_shapes(q_idx, k_idx, w):
    """dq_idx, dk_idx, dw: the inputs' shapes and dtypes."""
    return _same(q_idx, k_idx, w)


def sparse_mla_fwd_shapes(q, d_v):
    """o ``[T, H, d_v]`` in q's dtype, lse ``[T, H]`` in its accumulation dtype."""
    T, H = q.shape[:2]
    return ((T, H, d_v), q.dtype), ((T, H), acc_dtype(q.dtype))


def sparse_mla_bwd_shapes(q, kv):
    """dq, dkv."""
    return _same(q, kv)


def indexer_loss_fwd_shapes(scores):
    """loss (0-dim) and the target ``p [T, k]``, both in the scores' accumulation dtype."""
    acc = acc_dtype(scores.dtype)
    return ((), acc), (tuple(scores.shape), acc)


def indexer_loss_bwd_shapes(scores):
    """dscores."""
    return _same(scores)


def allocate(specs, device):
    """Contiguous empty tensors for a shape function's result (fakes and kernels alike)."""
    return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs)
