"""Time parallelism inside one chunked call: a rect batch cut into segments along T.

A call whose (sequence, head) pairs are few (one long sequence, a small batch) leaves the
sequential part of the chunked pass, the walk of the state along each sequence, on a few SMs.
Cutting every sequence into ``S`` equal segments runs ``B·S`` sequences instead, and the affine
chunk map of DESIGN.md §6 joins them, the algebra context parallelism uses across ranks
(:mod:`torch_dplr.affine`, :mod:`torch_dplr.cp`):

1. every segment from a zero state: its outputs ``o_zero`` and its end state ``c_s``;
2. every segment again with ``v = 0`` (width K) from the identity: its end state is the
   segment's transition ``M_s`` and its outputs ``scale·M_tᵀ q_t``, the term by which the
   segment's true start state enters each ``o_t``; when K == V both are one call of ``2·B·S``
   sequences;
3. the start states ``x_{s+1} = M_s x_s + c_s`` from the initial state (a log-depth scan), and
   ``o_t = o_zero_t + (scale·M_tᵀ q_t)ᵀ x_s``.

Step 2 doubles the chunk-local work, so it pays only where the walk is the bound.  Everything is
composed of the chunked ops and differentiable torch functions: the backward, checkpoint
policies and ``torch.compile`` see the same ops as an uncut call.

``TORCH_DPLR_TIME_SEGMENTS=<S>`` turns it on for rect calls whose ``T`` is a multiple of
``S · chunk_size`` (other calls run uncut); unset or 1: off.  It is read when a call is made
(when a compiled graph is traced).  Off by default: measured on an H100 it is 2-4x slower than
the uncut call at the long sequence, the small grid and the design shape for every S
(``python -m benchmarks.time_segments``, docs/training_dataflow.md).
"""
from __future__ import annotations

import os

import torch

from . import affine


def segments_for(q: torch.Tensor, cu_seqlens, chunk_size: int) -> int:
    """How many segments each sequence of this call is cut into (1: the call runs uncut)."""
    wanted = os.environ.get("TORCH_DPLR_TIME_SEGMENTS", "1")
    try:
        S = int(wanted)
    except ValueError:
        raise ValueError(f"TORCH_DPLR_TIME_SEGMENTS must be an integer, got {wanted!r}") from None
    if S < 1:
        raise ValueError(f"TORCH_DPLR_TIME_SEGMENTS must be at least 1, got {S}")
    if S == 1 or cu_seqlens is not None or q.shape[1] % (S * chunk_size):
        return 1
    return S


def segmented(run, q, k, v, a, b, gk, initial_state, S: int):
    """``run(q, k, v, a, b, gk, initial_state) -> (o, final_state)`` (the uncut chunked call on
    rect inputs, final state always returned) on every sequence cut into ``S`` segments, joined
    exactly; returns ``(o, final_state)``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    P = T // S

    def cut(x):
        return x.reshape(B * S, P, *x.shape[2:])

    data = [cut(x) for x in (q, k, a, b, gk)]
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    eye = torch.eye(K, dtype=state_dtype, device=q.device).expand(B * S, H, K, K)
    zero_v = q.new_zeros(B * S, P, H, K)
    if K == V:  # the two passes as one call of 2·B·S sequences
        q2, k2, a2, b2, gk2 = (torch.cat([x, x]) for x in data)
        h0 = torch.cat([eye.new_zeros(B * S, H, K, V), eye])
        o_all, ends = run(q2, k2, torch.cat([cut(v), zero_v]), a2, b2, gk2, h0)
        o_zero, o_carry = o_all[:B * S], o_all[B * S:]
        c, M = ends[:B * S], ends[B * S:]
    else:
        qc, kc, ac, bc, gkc = data
        o_zero, c = run(qc, kc, cut(v), ac, bc, gkc, None)
        o_carry, M = run(qc, kc, zero_v, ac, bc, gkc, eye)
    # start states: scan over the segments of each sequence (segment index leading)
    per_segment = lambda x: x.reshape(B, S, *x.shape[1:]).transpose(0, 1)  # noqa: E731
    h0 = None if initial_state is None else initial_state.to(state_dtype)
    x = affine.chain_states(per_segment(M.to(state_dtype)), per_segment(c.to(state_dtype)), h0)
    starts = x[:S].transpose(0, 1)  # [B, S, H, K, V]
    entering = torch.einsum("bsphk,bshkv->bsphv",
                            o_carry.reshape(B, S, P, H, K).to(state_dtype), starts)
    o = (o_zero.reshape(B, S, P, H, V).to(state_dtype) + entering).to(q.dtype)
    return o.reshape(B, T, H, V), x[S]
