"""``dsa::sparse_mla_fwd`` / ``dsa::sparse_mla_bwd``: attention over each query's selected keys.

Schemas:

- ``sparse_mla_fwd(Tensor q, Tensor kv, Tensor indices, float scale, int d_v)
  -> (Tensor o, Tensor lse)``
- ``sparse_mla_bwd(Tensor q, Tensor kv, Tensor indices, Tensor o, Tensor lse, Tensor do,
  Tensor dlse, float scale, int d_v) -> (Tensor dq, Tensor dkv)``

``q [T, H, D_qk]`` and ``kv [T, D_qk]`` of one dtype (absorbed MLA: one latent row per token
shared by every head; its first ``d_v`` columns are the value), ``indices [T, k]`` int32 in any
order, ``-1`` for an unused slot.  ``o [T, H, d_v]`` in q's dtype; ``lse [T, H]`` the natural-log
log-sum-exp of ``scale · q · kv`` over the valid slots, fp32 (fp64 for fp64 inputs); a row
without a valid slot gives ``o = 0`` and ``lse = -inf``.  The backward takes ``dlse`` (zeros when
lse got no gradient) and returns ``dq``, ``dkv`` in their inputs' dtypes (fp32 accumulation).
"""
from torch import Tensor
import torch

from ...ops.chunked import without_autocast
from ..reference import sparse_mla as ref
from ..reference.layout import check_index_range
from .shapes import acc_dtype, allocate, sparse_mla_bwd_shapes, sparse_mla_fwd_shapes


def _block_rows(q, indices):
    return ref.block_rows(indices.shape[1], q.shape[1], q.shape[2])


@without_autocast
def sparse_mla_fwd_reference(q: Tensor, kv: Tensor, indices: Tensor, scale: float,
                             d_v: int) -> tuple[Tensor, Tensor]:
    o, lse = allocate(sparse_mla_fwd_shapes(q, d_v), q.device)
    check_index_range(indices, kv.shape[0])
    acc = lse.dtype
    o_acc = torch.empty(o.shape, dtype=acc, device=q.device)
    ref.sparse_mla_fwd(q.to(acc), kv.to(acc), indices, float(scale), d_v, o_acc, lse,
                       _block_rows(q, indices))
    o.copy_(o_acc)
    return o, lse


sparse_mla_fwd = torch.library.custom_op("dsa::sparse_mla_fwd", mutates_args=())(
    sparse_mla_fwd_reference)


@sparse_mla_fwd.register_fake
def _(q, kv, indices, scale, d_v):
    return allocate(sparse_mla_fwd_shapes(q, d_v), q.device)


@without_autocast
def sparse_mla_bwd_reference(q: Tensor, kv: Tensor, indices: Tensor, o: Tensor, lse: Tensor,
                             do: Tensor, dlse: Tensor, scale: float, d_v: int
                             ) -> tuple[Tensor, Tensor]:
    dq, dkv = allocate(sparse_mla_bwd_shapes(q, kv), q.device)
    check_index_range(indices, kv.shape[0])
    acc = acc_dtype(q.dtype)
    dq_acc = torch.empty(dq.shape, dtype=acc, device=q.device)
    dkv_acc = torch.zeros(dkv.shape, dtype=acc, device=q.device)
    ref.sparse_mla_bwd(q.to(acc), kv.to(acc), indices, o.to(acc), lse.to(acc), do.to(acc),
                       dlse.to(acc), float(scale), d_v, dq_acc, dkv_acc, _block_rows(q, indices))
    dq.copy_(dq_acc)
    dkv.copy_(dkv_acc)
    return dq, dkv


sparse_mla_bwd = torch.library.custom_op("dsa::sparse_mla_bwd", mutates_args=())(
    sparse_mla_bwd_reference)


@sparse_mla_bwd.register_fake
def _(q, kv, indices, o, lse, do, dlse, scale, d_v):
    return allocate(sparse_mla_bwd_shapes(q, kv), q.device)


def _setup_context(ctx, inputs, output):
    q, kv, indices, scale, d_v = inputs
    o, lse = output
    ctx.save_for_backward(q, kv, indices, o, lse)
    ctx.config = (scale, d_v)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dlse):
    if do is None and dlse is None:
        return None, None, None, None, None
    q, kv, indices, o, lse = ctx.saved_tensors
    scale, d_v = ctx.config
    if do is None:
        do = torch.zeros_like(o)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    dq, dkv = torch.ops.dsa.sparse_mla_bwd(q, kv, indices, o, lse, do, dlse, scale, d_v)
    return dq, dkv, None, None, None


sparse_mla_fwd.register_autograd(_backward, setup_context=_setup_context)
