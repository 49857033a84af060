"""``dplr::chunk_fwd_fused``: the whole chunked forward in one op, for calls that need no gradient.

``(o, final state)`` from q, k, v, a, b, gk: what ``chunk_intra_fwd`` -> ``chunk_wy_fwd`` ->
``chunk_state_fwd`` (``keep_activations=False``) compute, with the same rounding points.  A
no-grad call keeps nothing for a backward, so on CUDA one TileLang kernel
(``csrc_tl/fused_fwd.py``) can keep every intermediate on chip; :func:`fused_kernel_applies`
says when it runs.  Otherwise the CUDA kernel composes the staged ops (their TileLang kernels),
and the CPU kernel composes their PyTorch stages (the oracle).

The final state is always returned (fixed arity); the API drops it when not asked for.  The op
is not differentiable: ``torch_dplr`` calls it only when no input requires grad, and its
registered backward raises.
"""

from typing import Optional

import torch
from torch import Tensor

from .chunked import without_autocast
from .direct_call import register_kernel
from .intra import chunk_intra_fwd_cuda, chunk_intra_fwd_reference
from .kernels import kernel_for, pipeline
from .shapes import allocate, fused_fwd_shapes, num_sequences
from .state import chunk_state_fwd_cuda, chunk_state_fwd_reference
from .tilelang_path import MAX_GRID_YZ, device_index, kernels_apply, sm_count
from .triton_path import per_token_kernel_applies
from .varlen import as_one_sequence_list as flat
from .varlen import tables_for
from .wy import chunk_wy_fwd_cuda, chunk_wy_fwd_reference


def fused_kernel_applies(q: Tensor, v: Tensor, gk: Tensor, cu_seqlens: Tensor, chunk_size: int,
                         lower_bound: float) -> bool:
    """Whether a CUDA call runs the fused kernel rather than the staged kernels.

    The kernel is built for C = 64, K = V = 64, bf16/fp16 data with fp32 or data-dtype gates,
    and the centred gate scheme only (a declared lower bound that keeps its exponents in
    range, the check ``chunk_intra_fwd`` makes): where ``kernels.pipeline`` lists
    ``"fused_fwd"`` for the call's configuration, and where the per-token Triton kernel can
    recompute the (sequence, head) pairs whose gates break the bound
    (:mod:`torch_dplr.ops.gate_bound`).  It walks each sequence's chunks serially,
    one CTA per (sequence, head), with no split over time: it pays only when those pairs fill
    the GPU.  With fewer pairs than SMs (a small batch, a few long sequences) most SMs would
    idle through the serial walk, while the staged intra / WY kernels run every chunk in
    parallel; such calls stay on the staged path.  Reads shapes only: no host sync.
    """
    H, K, V = q.shape[2], q.shape[-1], v.shape[-1]
    num_seqs = num_sequences(q, cu_seqlens)
    # the per-token kernel recomputes the pairs whose gates break the bound
    if not (num_seqs <= MAX_GRID_YZ and kernels_apply(q, chunk_size, K, V)
            and per_token_kernel_applies(q, v, gk, num_seqs)):
        return False
    # TileLang is importable from here on (kernels_apply checked it)
    return ("fused_fwd" in pipeline(chunk_size, K, V, q.dtype, gk.dtype, lower_bound)
            and num_seqs * H >= sm_count(device_index(q.device)))


def fused_kernel(q: Tensor, v: Tensor, gk: Tensor, cu_seqlens: Tensor, chunk_size: int,
                 lower_bound: float):
    """The compiled fused kernel for this CUDA call, or None: the staged kernels run (it does
    not apply, or it could not be built)."""
    if not fused_kernel_applies(q, v, gk, cu_seqlens, chunk_size, lower_bound):
        return None
    return kernel_for("fused_fwd", chunk_size, q.shape[-1], v.shape[-1], q.dtype, gk.dtype,
                      lower_bound)


def _compose(intra_fwd, wy_fwd, state_fwd, q, k, v, a, b, gk, initial_state, cu_seqlens,
             scale, chunk_size, lower_bound, use_initial_state, tables):
    """The staged forward through the given stage functions; returns (o, final state)."""
    gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = intra_fwd(q, k, a, b, gk, cu_seqlens, scale,
                                                           chunk_size, lower_bound, tables)
    _, w, u = wy_fwd(A_ab, A_ak, ag, v, cu_seqlens, chunk_size, tables)
    o, ht, _, _ = state_fwd(qg, kg, bg, w, u, v, A_qk, A_qb, gl, initial_state, cu_seqlens,
                            chunk_size, use_initial_state, False, tables)
    return o, ht


@without_autocast
def chunk_fwd_fused_reference(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor,
                              initial_state: Tensor, cu_seqlens: Tensor, scale: float,
                              chunk_size: int, lower_bound: float, use_initial_state: bool,
                              tables: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _compose(chunk_intra_fwd_reference, chunk_wy_fwd_reference, chunk_state_fwd_reference,
                    q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size, lower_bound,
                    use_initial_state, tables)


chunk_fwd_fused = torch.library.custom_op("dplr::chunk_fwd_fused", mutates_args=())(chunk_fwd_fused_reference)


@chunk_fwd_fused.register_fake
def _(q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size, lower_bound,
      use_initial_state, tables=None):
    return allocate(fused_fwd_shapes(q, v, cu_seqlens), q.device)


@register_kernel(chunk_fwd_fused, "cuda")
@without_autocast
def _(q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size, lower_bound,
      use_initial_state, tables=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    kernel = fused_kernel(q, v, gk, cu_seqlens, chunk_size, lower_bound)
    if kernel is None:
        # the staged ops' CUDA kernels, called as functions: this op is already past the
        # dispatcher, and each dispatch costs 40-50 us on the H200's host (tools/host_probe.py)
        return _compose(chunk_intra_fwd_cuda, chunk_wy_fwd_cuda, chunk_state_fwd_cuda,
                        q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size,
                        lower_bound, use_initial_state, tables)
    o, ht = allocate(fused_fwd_shapes(q, v, cu_seqlens), q.device)
    tables = tables_for(tables, cu_seqlens, B, T, chunk_size, q.device)
    # h0 with no rows tells the kernel to start from zero
    h0 = (initial_state.float() if use_initial_state else ht.new_empty(0, H, K, V)).contiguous()
    tokens = tuple(map(flat, (q, k, v, a, b, gk)))
    breaking = torch.zeros(ht.shape[:2], dtype=torch.int32, device=q.device)
    kernel(*tokens, h0, tables.cu_seqlens, tables.chunk_offsets, float(scale), flat(o), ht,
           breaking)
    # the (sequence, head) pairs with a chunk that broke the bound, recomputed exactly
    # token by token (ops/gate_bound.py)
    from csrc_triton import recurrent as per_token
    per_token.launch(*tokens, h0 if use_initial_state else ht, tables.cu_seqlens,
                     tables.cu_seqlens, flat(o), ht, float(scale), use_initial_state, False,
                     False, flags=breaking)
    return o, ht


def _backward(ctx, do, dht):
    raise RuntimeError("dplr::chunk_fwd_fused is a no-grad op; torch_dplr calls it only when "
                       "no input requires grad")


chunk_fwd_fused.register_autograd(_backward)
