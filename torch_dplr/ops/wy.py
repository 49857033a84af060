"""``dplr::chunk_wy_fwd`` / ``dplr::chunk_wy_bwd``: A_ab_inv = (I - A_ab)^-1, w, u.

``A_ab_inv`` is returned so the backward can reuse it; it is an auxiliary output for that
purpose (not differentiable).
"""

from typing import Optional

import torch
from torch import Tensor

from ..reference import wy as ref
from .chunked import ChunkedView, without_autocast
from .direct_call import call_op, register_autograd, register_kernel
from .shapes import acc_dtype, allocate, wy_bwd_shapes, wy_fwd_shapes, zeros_for_missing
from .kernels import kernel_for
from .tilelang_path import kernels_apply
from .varlen import as_one_sequence_list as flat
from .varlen import tables_for


@without_autocast
def chunk_wy_fwd_reference(A_ab: Tensor, A_ak: Tensor, ag: Tensor, v: Tensor, cu_seqlens: Tensor,
                           chunk_size: int, tables: Optional[Tensor] = None
                           ) -> tuple[Tensor, Tensor, Tensor]:
    outs = allocate(wy_fwd_shapes(A_ab, ag, v), v.device)
    view = ChunkedView(v, cu_seqlens, chunk_size)
    for out, x in zip(outs, ref.wy_fwd(*map(view.read, (A_ab, A_ak, ag, v)))):
        view.write(out, x)
    return outs


chunk_wy_fwd = torch.library.custom_op("dplr::chunk_wy_fwd", mutates_args=())(chunk_wy_fwd_reference)


@chunk_wy_fwd.register_fake
def _(A_ab, A_ak, ag, v, cu_seqlens, chunk_size, tables=None):
    return allocate(wy_fwd_shapes(A_ab, ag, v), v.device)


@register_kernel(chunk_wy_fwd, "cuda")
@without_autocast
def chunk_wy_fwd_cuda(A_ab, A_ak, ag, v, cu_seqlens, chunk_size, tables=None):
    B, T, _, K = ag.shape
    V = v.shape[-1]
    applies = kernels_apply(v, chunk_size, K, V) and A_ab.dtype == acc_dtype(v.dtype)
    kernel = kernel_for("wy_fwd", chunk_size, K, V, v.dtype) if applies else None
    if kernel is None:
        return chunk_wy_fwd_reference(A_ab, A_ak, ag, v, cu_seqlens, chunk_size)
    outs = allocate(wy_fwd_shapes(A_ab, ag, v), v.device)
    tables = tables_for(tables, cu_seqlens, B, T, chunk_size, v.device)
    kernel(*map(flat, (A_ab, A_ak, ag, v)), tables.chunk_start, tables.chunk_len, *map(flat, outs))
    return outs


@without_autocast
def chunk_wy_bwd_reference(A_ab_inv: Tensor, A_ak: Tensor, ag: Tensor, v: Tensor, dw: Tensor, du: Tensor,
                           cu_seqlens: Tensor, chunk_size: int, tables: Optional[Tensor] = None
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    outs = allocate(wy_bwd_shapes(A_ab_inv, A_ak, ag, v), v.device)
    view = ChunkedView(v, cu_seqlens, chunk_size)
    res = ref.wy_bwd(*map(view.read, (A_ab_inv, A_ak, ag, v, dw, du)))
    for out, x in zip(outs, res):
        view.write(out, x)
    return outs


chunk_wy_bwd = torch.library.custom_op("dplr::chunk_wy_bwd", mutates_args=())(chunk_wy_bwd_reference)


@chunk_wy_bwd.register_fake
def _(A_ab_inv, A_ak, ag, v, dw, du, cu_seqlens, chunk_size, tables=None):
    return allocate(wy_bwd_shapes(A_ab_inv, A_ak, ag, v), v.device)


@register_kernel(chunk_wy_bwd, "cuda")
@without_autocast
def chunk_wy_bwd_cuda(A_ab_inv, A_ak, ag, v, dw, du, cu_seqlens, chunk_size, tables=None):
    B, T, _, K = ag.shape
    V = v.shape[-1]
    applies = kernels_apply(v, chunk_size, K, V) and A_ab_inv.dtype == acc_dtype(v.dtype)
    kernel = kernel_for("wy_bwd", chunk_size, K, V, v.dtype) if applies else None
    if kernel is None:
        return chunk_wy_bwd_reference(A_ab_inv, A_ak, ag, v, dw, du, cu_seqlens, chunk_size)
    outs = allocate(wy_bwd_shapes(A_ab_inv, A_ak, ag, v), v.device)
    tables = tables_for(tables, cu_seqlens, B, T, chunk_size, v.device)
    kernel(*map(flat, (A_ab_inv, A_ak, ag, v, dw, du)), tables.chunk_start, tables.chunk_len,
           *map(flat, outs))
    return outs


def _setup_context(ctx, inputs, output):
    A_ab, A_ak, ag, v, cu_seqlens, chunk_size, tables = inputs
    A_ab_inv = output[0]
    ctx.mark_non_differentiable(A_ab_inv)
    ctx.save_for_backward(A_ab_inv, A_ak, ag, v, cu_seqlens, tables)
    ctx.chunk_size = chunk_size
    ctx.set_materialize_grads(False)


def _backward(ctx, dA_ab_inv, dw, du):
    A_ab_inv, A_ak, ag, v, cu_seqlens, tables = ctx.saved_tensors
    dw, du = zeros_for_missing((dw, du), wy_fwd_shapes(A_ab_inv, ag, v)[1:], v.device)
    dA_ab, dA_ak, dag, dv = call_op(torch.ops.dplr.chunk_wy_bwd, A_ab_inv, A_ak, ag, v, dw, du,
                                    cu_seqlens, ctx.chunk_size, tables)
    return dA_ab, dA_ak, dag, dv, None, None, None


register_autograd(chunk_wy_fwd, _backward, _setup_context)
