"""``dplr::decode_pool``: the per-token recurrence for requests whose states live in one pool.

A serving engine keeps every live request's state in a pool ``state_pool [slots, H, K, V]``
(the state dtype: fp32, fp64 for fp64 data; or bf16 storage, :data:`POOL_STORE_DTYPE`) and
names each request's slot in ``slot_indices [N]`` (int32). One call reads those states,
advances each request by its tokens (T = 1 decode, or a few tokens: a short prefill, a
speculative block) and writes the states back into their slots **in place**:
``mutates_args=("state_pool",)``. A functional op would return a new pool, copying every slot
each step, and decode is bound by exactly that state traffic. A mutating op has no autograd
formula; the op is for inference only (the public entry, :mod:`torch_dplr.serving`, refuses
inputs that require grad).

Schema (fixed arity, an absent ``cu_seqlens`` is a size-0 tensor)::

    dplr::decode_pool(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor gk,
                      Tensor(a!) state_pool, Tensor slot_indices, Tensor cu_seqlens,
                      float scale) -> Tensor o

The kernel registered here is plain PyTorch and serves every device.  Rect calls (every
request has T tokens) read no tensor values on the host, so on CUDA they can be captured in a
CUDA graph; varlen calls read ``cu_seqlens`` through ``dplr::recurrent_fwd`` (a host sync on
CUDA).  A device kernel is added with ``decode_pool.register_kernel("cuda")`` under the same
schema.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .direct_call import register_kernel
from .recurrent import per_token_kernel, sequence_offsets, token_tensors
from .triton_path import per_token_kernel_applies


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a state (and of the pool) for data of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: A pool's lower-precision storage: the states are read into fp32, advanced in fp32 and
#: rounded to it once per call when written back (half the state traffic of a decode step).
POOL_STORE_DTYPE = torch.bfloat16


def pool_dtypes(dtype: torch.dtype) -> tuple:
    """The dtypes a state pool may have for data of ``dtype``: the state dtype, and bf16
    storage except for fp64 data."""
    state = state_dtype(dtype)
    return (state,) if state == torch.float64 else (state, POOL_STORE_DTYPE)


def decode_pool_shapes(q: Tensor, v: Tensor) -> tuple:
    """``o [B, T, H, V]`` in v's dtype (the only output: the states go back into the pool)."""
    B, T, H, _ = q.shape
    return (((B, T, H, v.shape[-1]), v.dtype),)


def _allocate(specs, device) -> tuple:
    return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs)


def check_slot_values(slots: list, num_slots: int) -> None:
    """Every slot index in ``[0, num_slots)`` and no slot named twice (two requests writing
    one slot would leave it holding either state)."""
    bad = [s for s in slots if not 0 <= s < num_slots]
    if bad:
        raise ValueError(f"slot_indices must lie in [0, {num_slots}) (the pool's slots), "
                         f"got {bad[:8]}")
    if len(set(slots)) != len(slots):
        seen, repeated = set(), []
        for s in slots:
            if s in seen and s not in repeated:
                repeated.append(s)
            seen.add(s)
        raise ValueError(f"slot_indices must name each slot at most once, got {repeated[:8]} "
                         f"more than once")


def _advance(S, q, k, v, a, b, gk, scale, o):
    """Every request's state ``S [N, H, K, V]`` through its T tokens (rect ``[N, T, H, D]``
    inputs), writing ``o``; the loop runs over T, a shape, so nothing is read on the host."""
    acc = S.dtype
    for t in range(q.shape[1]):
        q_t, k_t, v_t, a_t, b_t, g_t = (x[:, t].to(acc) for x in (q, k, v, a, b, gk))
        a_S = torch.einsum("nhk,nhkv->nhv", a_t, S)
        S = (torch.exp(g_t)[..., None] * S + b_t[..., None] * a_S[..., None, :]
             + k_t[..., None] * v_t[..., None, :])
        o[:, t] = torch.einsum("nhk,nhkv->nhv", q_t, S).mul_(scale)
    return S


def _autocast_off(device: torch.device):
    """The kernel computes in its own dtypes: a caller's autocast must not reach inside."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def decode_pool_reference(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor,
                          state_pool: Tensor, slot_indices: Tensor, cu_seqlens: Tensor,
                          scale: float) -> Tensor:
    with _autocast_off(q.device):
        return _decode(q, k, v, a, b, gk, state_pool, slot_indices, cu_seqlens, scale)


def _decode(q, k, v, a, b, gk, state_pool, slot_indices, cu_seqlens, scale):
    (o,) = _allocate(decode_pool_shapes(q, v), q.device)
    if slot_indices.device.type == "cpu":
        # free on the host: guards calls the public entry could not check (compiled ones)
        check_slot_values(slot_indices.tolist(), state_pool.shape[0])
    index = slot_indices.long()
    S = state_pool.index_select(0, index).to(state_dtype(q.dtype))
    if cu_seqlens.numel() == 0:
        S = _advance(S, q, k, v, a, b, gk, scale, o)
    else:
        o_new, S = torch.ops.dplr.recurrent_fwd(q, k, v, a, b, gk, S, cu_seqlens, scale,
                                                True, False)
        o.copy_(o_new)
    state_pool.index_copy_(0, index, S.to(state_pool.dtype))
    return o


decode_pool = torch.library.custom_op("dplr::decode_pool",
                                      mutates_args=("state_pool",))(decode_pool_reference)


@decode_pool.register_fake
def _(q, k, v, a, b, gk, state_pool, slot_indices, cu_seqlens, scale):
    return _allocate(decode_pool_shapes(q, v), q.device)[0]


@register_kernel(decode_pool, "cuda")
def decode_pool_cuda(q, k, v, a, b, gk, state_pool, slot_indices, cu_seqlens, scale):
    """``csrc_triton.recurrent`` reads each request's state from its pool row and writes the
    new state back into it (no gather, no scatter, no host sync); calls it does not take
    (see :func:`~torch_dplr.ops.triton_path.per_token_kernel_applies`, and an fp32 or bf16
    pool) run the PyTorch kernel."""
    N = slot_indices.shape[0]
    if not (state_pool.dtype in (torch.float32, POOL_STORE_DTYPE) and state_pool.is_contiguous()
            and per_token_kernel_applies(q, v, gk, N)):
        return decode_pool_reference(q, k, v, a, b, gk, state_pool, slot_indices, cu_seqlens,
                                     scale)
    (o,) = _allocate(decode_pool_shapes(q, v), q.device)
    rows = slot_indices if slot_indices.dtype == torch.int32 else slot_indices.to(torch.int32)
    per_token_kernel().launch(*token_tensors(q, k, v, a, b, gk), state_pool, rows,
                              sequence_offsets(cu_seqlens), o,
                              state_pool, float(scale), True, True, False)
    return o
