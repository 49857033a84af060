"""One shape function per op: the fake and the real kernel both allocate through these.

Each returns a tuple of ``(shape, dtype)``; they read only shapes, dtypes and Python scalars,
so they run on FakeTensors and SymInts alike.
"""
from __future__ import annotations

import torch

from ..reference.layout import chunk_slots_per_batch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation / state dtype: fp64 stays fp64, everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def varlen_sequences(cu_seqlens):
    """N for a varlen call (``cu_seqlens`` [N+1]), None for a rect one (empty sentinel)."""
    return None if cu_seqlens.numel() == 0 else cu_seqlens.shape[0] - 1


def num_sequences(x, cu_seqlens):
    """Sequences of a call whose token tensor is ``x`` [B, T, ...]: B for a rect batch, N for
    varlen (``cu_seqlens`` [N+1]); one final state each.  Shapes only: no host sync."""
    return x.shape[0] if cu_seqlens.numel() == 0 else cu_seqlens.shape[0] - 1


def _output_and_final_state(q, v, cu_seqlens, state_dtype):
    """o [B, T, H, V] in v's dtype and the final state [N, H, K, V]: every forward returns them."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    return ((B, T, H, V), v.dtype), ((num_sequences(q, cu_seqlens), H, K, V), state_dtype)


def intra_fwd_shapes(q, gk, cu_seqlens, chunk_size):
    """gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg."""
    B, T, H, K = q.shape
    acc = acc_dtype(q.dtype)
    slots = chunk_slots_per_batch(T, chunk_size, varlen_sequences(cu_seqlens))
    mat = (B, T, H, chunk_size)
    return (((B, slots, H, K), acc), (mat, q.dtype), (mat, q.dtype), (mat, acc), (mat, acc),
            *(((B, T, H, K), q.dtype),) * 4)


def intra_bwd_shapes(q, k, a, b, gk):
    """dq, dk, da, db, dgk."""
    return tuple((tuple(x.shape), x.dtype) for x in (q, k, a, b, gk))


def wy_fwd_shapes(A_ab, ag, v):
    """A_ab_inv, w, u."""
    return ((tuple(A_ab.shape), A_ab.dtype), (tuple(ag.shape), ag.dtype), (tuple(v.shape), v.dtype))


def wy_bwd_shapes(A_ab, A_ak, ag, v):
    """dA_ab, dA_ak, dag, dv."""
    return tuple((tuple(x.shape), x.dtype) for x in (A_ab, A_ak, ag, v))


def state_fwd_shapes(qg, v, gl, cu_seqlens, keep_activations):
    """o, final_state, h (per chunk slot, state at the chunk's start), v_new."""
    B, T, H, K = qg.shape
    V = v.shape[-1]
    acc = gl.dtype
    kept = keep_activations
    h = (B, gl.shape[1], H, K, V) if kept else (0,)
    return (*_output_and_final_state(qg, v, cu_seqlens, acc),
            (h, acc), ((B, T, H, V) if kept else (0,), v.dtype))


def state_bwd_shapes(qg, kg, bg, w, v, A_qk, A_qb, gl, initial_state, use_initial_state):
    """dqg, dkg, dbg, dw, du, dv, dA_qk, dA_qb, dgl, dh0."""
    same = tuple((tuple(x.shape), x.dtype) for x in (qg, kg, bg, w, v, v, A_qk, A_qb, gl))
    dh0 = (tuple(initial_state.shape), initial_state.dtype) if use_initial_state else ((0,), gl.dtype)
    return (*same, dh0)


def recurrent_fwd_shapes(q, v, cu_seqlens):
    """o, final_state."""
    return _output_and_final_state(q, v, cu_seqlens, acc_dtype(q.dtype))


# o, final_state of the fused no-grad forward (the final state always: fixed arity): the same
# pair as the per-token forward's
fused_fwd_shapes = recurrent_fwd_shapes


def recurrent_bwd_shapes(q, k, v, a, b, gk, initial_state, use_initial_state):
    """dq, dk, dv, da, db, dgk, dh0."""
    grads = tuple((tuple(x.shape), x.dtype) for x in (q, k, v, a, b, gk))
    dh0 = (tuple(initial_state.shape), initial_state.dtype) if use_initial_state \
        else ((0,), acc_dtype(q.dtype))
    return (*grads, dh0)


def chunk_fwd_shapes(q, v, cu_seqlens, chunk_size):
    """o, final_state, the state at every chunk start (``[B, slots, H, K, V]``, the stage
    ops' per-chunk layout)."""
    B, T, H, K = q.shape
    acc = acc_dtype(q.dtype)
    slots = chunk_slots_per_batch(T, chunk_size, varlen_sequences(cu_seqlens))
    return (*_output_and_final_state(q, v, cu_seqlens, acc), ((B, slots, H, K, v.shape[-1]), acc))


# dq, dk, dv, da, db, dgk, dh0 of the chunked backward: those of the per-token one
chunk_bwd_shapes = recurrent_bwd_shapes


def allocate(specs, device):
    """Contiguous empty tensors for a shape function's result (fakes and kernels alike)."""
    return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs)


def zeros_for_missing(grads, specs, device):
    """Autograd hands ``None`` for outputs that did not reach the loss; kernels take zeros."""
    return [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype) in zip(grads, specs)]
