"""``dplr::recurrent_fwd`` / ``dplr::recurrent_bwd``: the per-token recurrence (decode, short T).

On CUDA (:mod:`torch_dplr.ops.triton_path`) the forward runs ``csrc_triton.recurrent`` (one
token at a time, state in registers: decode, short sequences) or, for sequences of more than
:data:`PER_TOKEN_MAX_AVG_LEN` tokens on average, the chunked sweep ``csrc_triton.chunk_fwd``,
which gives the same result with 16-token tiles.  The backward recomputes the forward's
chunk-start states with the sweep and differentiates it in one reverse sweep
(``csrc_triton.chunk_bwd``): nothing of the forward is saved but its inputs.  Neither reads a
tensor value on the host, so both can be captured in a CUDA graph.

With ``rwkv7_pair`` the ``a`` and ``b`` arguments are RWKV-7's ``kk`` and in-context rate ``a``
and the recurrence runs on the pair ``(-kk, kk·a)`` formed inside the op (FLA's
``fused_mul_recurrent_rwkv7``): in fp32 by the per-token kernel and the PyTorch kernel, in the
data dtype before the chunked sweep and in the backward (:func:`dplr_pair`).

A decode step is one small launch, so its host time is the call's time: the per-token entries
call their op through :func:`torch_dplr.ops.direct_call.call_op` and the CUDA bodies hand the
kernel the inputs as they are (:func:`token_tensors`).
"""

import functools

import torch
from torch import Tensor

from ..reference import recurrent as ref
from .chunked import SequenceView, start_state, without_autocast
from .direct_call import call_op, register_autograd, register_kernel
from .shapes import (allocate, num_sequences, recurrent_bwd_shapes, recurrent_fwd_shapes,
                     zeros_for_missing)
from .triton_path import SWEEP_CHUNK, per_token_kernel_applies, sweep_kernels_apply
from .varlen import as_one_sequence_list as flat
from .varlen import kernel_tables

# Average tokens per sequence up to which the per-token kernel runs the forward; longer
# sequences take the chunked sweep (16 tokens a step).
PER_TOKEN_MAX_AVG_LEN = 64


def sequence_offsets(cu_seqlens: Tensor) -> Tensor | None:
    """The per-token kernel's ``cu_seqlens``: int32 offsets of a varlen call's sequences, or
    None for a rect call (size-0 ``cu_seqlens``), whose sequences the kernel finds itself."""
    if not cu_seqlens.numel():
        return None
    return cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)


@functools.cache
def per_token_kernel():
    """``csrc_triton.recurrent``, imported on first use (Triton is an optional dependency;
    an ``import`` statement in the op body costs host time on every call)."""
    from csrc_triton import recurrent
    return recurrent


def token_tensors(*xs: Tensor) -> tuple:
    """The per-token kernel's token tensors: contiguous ``[B, T, H, D]`` as they come.  Its
    launch reads only H and D from a shape, and a contiguous ``[B, T, H, D]`` is the same
    memory as the flattened token list ``[1, B*T, H, D]``, so the views
    :func:`~torch_dplr.ops.varlen.as_one_sequence_list` makes (about 1 us of host time each,
    seven a decode step) are left out."""
    return tuple(map(Tensor.contiguous, xs))


def dplr_pair(a: Tensor, b: Tensor, rwkv7_pair: bool) -> tuple[Tensor, Tensor]:
    """The recurrence's ``(a, b)``: as given, or from RWKV-7's ``(kk, a)`` the pair
    ``(-kk, kk·a)`` in their dtype."""
    return (-a, a * b) if rwkv7_pair else (a, b)


@without_autocast
def recurrent_fwd_reference(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor,
                            initial_state: Tensor, cu_seqlens: Tensor, scale: float,
                            use_initial_state: bool, reverse: bool, rwkv7_pair: bool = False
                            ) -> tuple[Tensor, Tensor]:
    o, ht = allocate(recurrent_fwd_shapes(q, v, cu_seqlens), q.device)
    view = SequenceView(q, cu_seqlens, reverse)
    h0 = start_state(initial_state, use_initial_state, ht.shape, view.dtype, q.device)
    a_seq, b_seq = dplr_pair(view.read(a), view.read(b), rwkv7_pair)
    o_seq, h_end = ref.recurrent_fwd(view.read(q), view.read(k), view.read(v), a_seq, b_seq,
                                     view.read(gk), h0, scale)
    view.write(o, o_seq)
    ht.copy_(h_end)
    return o, ht


recurrent_fwd = torch.library.custom_op("dplr::recurrent_fwd", mutates_args=())(recurrent_fwd_reference)


def _state_ok(initial_state, use_initial_state) -> bool:
    # the kernels read and write fp32 states
    return not use_initial_state or initial_state.dtype == torch.float32


@register_kernel(recurrent_fwd, "cuda")
@without_autocast
def recurrent_fwd_cuda(q, k, v, a, b, gk, initial_state, cu_seqlens, scale, use_initial_state,
                       reverse, rwkv7_pair=False):
    B, T = q.shape[:2]
    N = num_sequences(q, cu_seqlens)
    short = B * T <= PER_TOKEN_MAX_AVG_LEN * N
    sweep = not short and sweep_kernels_apply(q, v, gk, N)
    if not (_state_ok(initial_state, use_initial_state)
            and (sweep or per_token_kernel_applies(q, v, gk, N))):
        return recurrent_fwd_reference(q, k, v, a, b, gk, initial_state, cu_seqlens, scale,
                                       use_initial_state, reverse, rwkv7_pair)
    o, ht = allocate(recurrent_fwd_shapes(q, v, cu_seqlens), q.device)
    h0 = initial_state.contiguous() if use_initial_state else ht  # fp32 (_state_ok)
    if sweep:
        a, b = dplr_pair(a, b, rwkv7_pair)
        _sweep_forward(tuple(map(flat, (q, k, v, a, b, gk))), h0, cu_seqlens, B, T, flat(o),
                       ht, scale, use_initial_state, reverse, store_states=False)
        return o, ht
    per_token_kernel().launch(*token_tensors(q, k, v, a, b, gk), h0, None,
                              sequence_offsets(cu_seqlens), o, ht,
                              float(scale), use_initial_state, False, bool(reverse),
                              rwkv7_pair=bool(rwkv7_pair))
    return o, ht


def _sweep_forward(tokens, h0, cu_seqlens, B, T, o, ht, scale, use_h0, reverse, store_states):
    """The chunked sweep forward over flattened ``tokens``; returns (tables, states, flags)
    for its backward."""
    from csrc_triton import chunk_fwd
    q, v = tokens[0], tokens[2]
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    tables = kernel_tables(cu_seqlens, B, T, SWEEP_CHUNK, q.device)
    N = tables.cu_seqlens.shape[0] - 1
    states = (ht.new_empty(1, tables.chunk_start.shape[0], H, K, V) if store_states
              else ht.new_empty(0))
    flags = torch.empty(N, H, dtype=torch.int32, device=q.device)
    chunk_fwd.launch(*tokens, h0, tables.cu_seqlens, tables.chunk_offsets, o, ht, states,
                     flags, float(scale), SWEEP_CHUNK, use_h0, store_states, True,
                     bool(reverse))
    return tables, states, flags


@recurrent_fwd.register_fake
def _(q, k, v, a, b, gk, initial_state, cu_seqlens, scale, use_initial_state, reverse,
      rwkv7_pair=False):
    return allocate(recurrent_fwd_shapes(q, v, cu_seqlens), q.device)


@without_autocast
def recurrent_bwd_reference(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor,
                            initial_state: Tensor, cu_seqlens: Tensor, do: Tensor, dht: Tensor,
                            scale: float, use_initial_state: bool, use_dht: bool, reverse: bool
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    outs = allocate(recurrent_bwd_shapes(q, k, v, a, b, gk, initial_state, use_initial_state),
                    q.device)
    view = SequenceView(q, cu_seqlens, reverse)
    state_shape = recurrent_fwd_shapes(q, v, cu_seqlens)[1][0]
    h0 = start_state(initial_state, use_initial_state, state_shape, view.dtype, q.device)
    dh_end = start_state(dht, use_dht, state_shape, view.dtype, q.device)
    *grads, dh0 = ref.recurrent_bwd(*map(view.read, (q, k, v, a, b, gk)), h0, scale,
                                    view.read(do), dh_end)
    for out, x in zip(outs[:6], grads):
        view.write(out, x)
    if use_initial_state:
        outs[6].copy_(dh0)
    return outs


recurrent_bwd = torch.library.custom_op("dplr::recurrent_bwd", mutates_args=())(recurrent_bwd_reference)


@register_kernel(recurrent_bwd, "cuda")
@without_autocast
def recurrent_bwd_cuda(q, k, v, a, b, gk, initial_state, cu_seqlens, do, dht, scale,
                       use_initial_state, use_dht, reverse):
    B, T, H, K = q.shape
    if not (_state_ok(initial_state, use_initial_state)
            and sweep_kernels_apply(q, v, gk, num_sequences(q, cu_seqlens))):
        return recurrent_bwd_reference(q, k, v, a, b, gk, initial_state, cu_seqlens, do, dht,
                                       scale, use_initial_state, use_dht, reverse)
    from csrc_triton import chunk_bwd
    outs = allocate(recurrent_bwd_shapes(q, k, v, a, b, gk, initial_state, use_initial_state),
                    q.device)
    o, ht = allocate(recurrent_fwd_shapes(q, v, cu_seqlens), q.device)
    h0 = initial_state.float().contiguous() if use_initial_state else ht
    tokens = tuple(map(flat, (q, k, v, a, b, gk)))
    tables, states, flags = _sweep_forward(tokens, h0, cu_seqlens, B, T, flat(o), ht, scale,
                                           use_initial_state, reverse, store_states=True)
    N = tables.cu_seqlens.shape[0] - 1
    workspace = ht.new_empty(chunk_bwd.workspace_shape(H, N, SWEEP_CHUNK // 16, K, K))
    dht4 = dht.float().reshape(N, H, K, K).contiguous() if use_dht else ht
    dh0 = outs[6] if use_initial_state else ht
    chunk_bwd.launch(*tokens, states, flat(do.contiguous()), dht4, tables.cu_seqlens,
                     tables.chunk_offsets, flags, workspace, *map(flat, outs[:6]), dh0,
                     float(scale), SWEEP_CHUNK, use_dht, use_initial_state, True, bool(reverse))
    return outs


@recurrent_bwd.register_fake
def _(q, k, v, a, b, gk, initial_state, cu_seqlens, do, dht, scale, use_initial_state, use_dht,
      reverse):
    return allocate(recurrent_bwd_shapes(q, k, v, a, b, gk, initial_state, use_initial_state),
                    q.device)


def _setup_context(ctx, inputs, output):
    (q, k, v, a, b, gk, initial_state, cu_seqlens, scale, use_initial_state, reverse,
     rwkv7_pair) = inputs
    ctx.save_for_backward(q, k, v, a, b, gk, initial_state, cu_seqlens)
    ctx.config = (scale, use_initial_state, reverse, rwkv7_pair)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dht):
    q, k, v, a, b, gk, initial_state, cu_seqlens = ctx.saved_tensors
    scale, use_initial_state, reverse, rwkv7_pair = ctx.config
    (do,) = zeros_for_missing((do,), [(v.shape, v.dtype)], v.device)
    use_dht = dht is not None
    if dht is None:
        dht = q.new_zeros(0, dtype=torch.float32)
    a_pair, b_pair = dplr_pair(a, b, rwkv7_pair)
    dq, dk, dv, da, db, dgk, dh0 = call_op(
        torch.ops.dplr.recurrent_bwd, q, k, v, a_pair, b_pair, gk, initial_state, cu_seqlens,
        do, dht, scale, use_initial_state, use_dht, reverse)
    if rwkv7_pair:  # through a_pair = -kk, b_pair = kk·a (a holds kk, b RWKV-7's a)
        wide = torch.promote_types(a.dtype, torch.float32)
        da, db, kk, rate = da.to(wide), db.to(wide), a.to(wide), b.to(wide)
        da, db = (rate * db - da).to(a.dtype), (kk * db).to(b.dtype)
    dh0 = dh0 if use_initial_state else None
    return dq, dk, dv, da, db, dgk, dh0, None, None, None, None, None


register_autograd(recurrent_fwd, _backward, _setup_context)
