"""``dplr::chunk_intra_fwd`` / ``dplr::chunk_intra_bwd``: gated q/k/a/b and the intra-chunk matrices.

Outputs of the forward (see DESIGN.md §1): ``gl`` (per chunk slot, log2 units), ``A_qk``,
``A_qb``, ``A_ak``, ``A_ab`` (``[B, T, H, C]``: row = token, column = position in its chunk),
``qg``, ``kg``, ``ag``, ``bg``.  ``lower_bound`` (``-inf`` when undeclared) only lets a GPU
kernel pick a faster scheme, whose chunks that break the bound are recomputed exactly
(:mod:`torch_dplr.ops.gate_bound`; the backward reads the forward's ``gl`` for that and the
PyTorch kernel ignores it); the PyTorch kernel is exact for any gate.
"""

from typing import Optional

from torch import Tensor
import torch

from ..reference import intra as ref
from .chunked import ChunkedView, without_autocast
from .direct_call import call_op, register_autograd, register_kernel
from .shapes import allocate, intra_bwd_shapes, intra_fwd_shapes, zeros_for_missing
from .kernels import kernel_for, pipeline
from .tilelang_path import kernels_apply
from .varlen import as_one_sequence_list as flat
from .varlen import tables_for


def _intra_kernel_applies(q, gk, chunk_size) -> bool:
    # gates in fp32 or in the data dtype; the state kernels need V = K, assumed here
    K = q.shape[-1]
    return gk.dtype in (torch.float32, q.dtype) and kernels_apply(q, chunk_size, K, K)


Tensors9 = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@without_autocast
def chunk_intra_fwd_reference(q: Tensor, k: Tensor, a: Tensor, b: Tensor, gk: Tensor, cu_seqlens: Tensor,
                              scale: float, chunk_size: int, lower_bound: float,
                              tables: Optional[Tensor] = None) -> Tensors9:
    outs = allocate(intra_fwd_shapes(q, gk, cu_seqlens, chunk_size), q.device)
    view = ChunkedView(q, cu_seqlens, chunk_size)
    gl, *mats_and_gated = ref.intra_fwd(*map(view.read, (q, k, a, b, gk)), scale)
    view.write_slots(outs[0], gl)
    for out, x in zip(outs[1:], mats_and_gated):
        view.write(out, x)
    return outs


chunk_intra_fwd = torch.library.custom_op("dplr::chunk_intra_fwd", mutates_args=())(chunk_intra_fwd_reference)


@chunk_intra_fwd.register_fake
def _(q, k, a, b, gk, cu_seqlens, scale, chunk_size, lower_bound, tables=None):
    return allocate(intra_fwd_shapes(q, gk, cu_seqlens, chunk_size), q.device)


def _kernels(op: str, q: Tensor, gk: Tensor, chunk_size: int, lower_bound: float):
    """(kernel, exact kernel) of an intra op's call: the exact one only where the declared
    bound selects a faster scheme (it recomputes the chunks that break the bound,
    :mod:`torch_dplr.ops.gate_bound`).  None for the kernel: the PyTorch kernel runs, also
    when the exact kernel it would need cannot be built."""
    if not _intra_kernel_applies(q, gk, chunk_size):
        return None, None
    K = q.shape[-1]
    config = (chunk_size, K, K, q.dtype, gk.dtype, lower_bound)
    kernel = kernel_for(op, *config)
    if f"{op}_exact" not in pipeline(*config):
        return kernel, None
    exact = kernel_for(f"{op}_exact", *config)
    return (kernel, exact) if exact is not None else (None, None)


@register_kernel(chunk_intra_fwd, "cuda")
@without_autocast
def chunk_intra_fwd_cuda(q, k, a, b, gk, cu_seqlens, scale, chunk_size, lower_bound, tables=None):
    B, T, _, K = q.shape
    kernel, exact = _kernels("intra_fwd", q, gk, chunk_size, lower_bound)
    if kernel is None:
        return chunk_intra_fwd_reference(q, k, a, b, gk, cu_seqlens, scale, chunk_size,
                                         lower_bound)
    outs = allocate(intra_fwd_shapes(q, gk, cu_seqlens, chunk_size), q.device)
    tables = tables_for(tables, cu_seqlens, B, T, chunk_size, q.device)
    inputs = tuple(map(flat, (q, k, a, b, gk)))
    launch = (*inputs, tables.chunk_start, tables.chunk_len, float(scale), *map(flat, outs))
    kernel(*launch)
    if exact is not None:  # rewrites the (chunk, head)s whose gl broke the bound (gate_bound.py)
        exact(*launch)
    return outs


@without_autocast
def chunk_intra_bwd_reference(q: Tensor, k: Tensor, a: Tensor, b: Tensor, gk: Tensor, cu_seqlens: Tensor,
                              gl: Tensor, dgl: Tensor, dA_qk: Tensor, dA_qb: Tensor, dA_ak: Tensor, dA_ab: Tensor,
                              dqg: Tensor, dkg: Tensor, dag: Tensor, dbg: Tensor,
                              scale: float, chunk_size: int, lower_bound: float,
                              tables: Optional[Tensor] = None
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    outs = allocate(intra_bwd_shapes(q, k, a, b, gk), q.device)
    view = ChunkedView(q, cu_seqlens, chunk_size)
    inputs = map(view.read, (q, k, a, b, gk))
    grads = map(view.read, (dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg))
    res = ref.intra_bwd(*inputs, scale, *grads, view.read_slots(dgl))
    for out, x in zip(outs, res):
        view.write(out, x)
    return outs


chunk_intra_bwd = torch.library.custom_op("dplr::chunk_intra_bwd", mutates_args=())(chunk_intra_bwd_reference)


@chunk_intra_bwd.register_fake
def _(q, k, a, b, gk, cu_seqlens, *rest):
    return allocate(intra_bwd_shapes(q, k, a, b, gk), q.device)


@register_kernel(chunk_intra_bwd, "cuda")
@without_autocast
def chunk_intra_bwd_cuda(q, k, a, b, gk, cu_seqlens, gl, dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg,
                         dkg, dag, dbg, scale, chunk_size, lower_bound, tables=None):
    grads = (dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg)
    B, T, _, K = q.shape
    kernel, exact = _kernels("intra_bwd", q, gk, chunk_size, lower_bound)
    if kernel is None:
        return chunk_intra_bwd_reference(q, k, a, b, gk, cu_seqlens, gl, *grads, scale,
                                         chunk_size, lower_bound)
    outs = allocate(intra_bwd_shapes(q, k, a, b, gk), q.device)
    tables = tables_for(tables, cu_seqlens, B, T, chunk_size, q.device)
    inputs = tuple(map(flat, (q, k, a, b, gk, gl, *grads)))
    launch = (*inputs, tables.chunk_start, tables.chunk_len, float(scale), *map(flat, outs))
    kernel(*launch)
    if exact is not None:  # rewrites the (chunk, head)s whose gl broke the bound (gate_bound.py)
        exact(*launch)
    return outs


def _setup_context(ctx, inputs, output):
    q, k, a, b, gk, cu_seqlens, scale, chunk_size, lower_bound, tables = inputs
    # gl (one row per chunk slot) tells the backward's GPU kernel which chunks broke the bound
    ctx.save_for_backward(q, k, a, b, gk, cu_seqlens, tables, output[0])
    ctx.config = (scale, chunk_size, lower_bound)
    ctx.set_materialize_grads(False)


def _backward(ctx, *grads):
    q, k, a, b, gk, cu_seqlens, tables, gl = ctx.saved_tensors
    scale, chunk_size, lower_bound = ctx.config
    specs = intra_fwd_shapes(q, gk, cu_seqlens, chunk_size)
    grads = zeros_for_missing(grads, specs, q.device)
    dq, dk, da, db, dgk = call_op(torch.ops.dplr.chunk_intra_bwd, q, k, a, b, gk, cu_seqlens,
                                  gl, *grads, scale, chunk_size, lower_bound, tables)
    return dq, dk, da, db, dgk, None, None, None, None, None


register_autograd(chunk_intra_fwd, _backward, _setup_context)
