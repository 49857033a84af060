"""``dsa::indexer_fwd`` / ``dsa::indexer_bwd``: lightning-indexer scores at selected keys.

Schemas:

- ``indexer_fwd(Tensor q_idx, Tensor k_idx, Tensor w, Tensor indices) -> Tensor scores``
- ``indexer_bwd(Tensor q_idx, Tensor k_idx, Tensor w, Tensor indices, Tensor dscores)
  -> (Tensor dq_idx, Tensor dk_idx, Tensor dw)``

``scores[t, j] = Σ_h w[t, h] · ReLU(q_idx[t, h] · k_idx[indices[t, j]])``, ``-inf`` where
``indices[t, j] = -1``; ``q_idx [T, H_idx, D_idx]``, ``k_idx [T, D_idx]`` of one dtype, ``w
[T, H_idx]`` any float dtype, ``indices [T, k]`` int32 in any order.  ``scores [T, k]`` is fp32
(fp64 for fp64 ``q_idx``); gradients come back in their inputs' dtypes, accumulated in fp32.
No scaling is applied: DeepSeek-V3.2 folds ``H_idx ** -0.5 · D_idx ** -0.5`` into ``w``.
"""
from torch import Tensor
import torch

from ...ops.chunked import without_autocast
from ..reference import indexer as ref
from ..reference.layout import check_index_range
from .shapes import acc_dtype, allocate, indexer_bwd_shapes, indexer_fwd_shapes


@without_autocast
def indexer_fwd_reference(q_idx: Tensor, k_idx: Tensor, w: Tensor, indices: Tensor) -> Tensor:
    (scores,) = allocate(indexer_fwd_shapes(q_idx, indices), q_idx.device)
    check_index_range(indices, k_idx.shape[0])
    acc = scores.dtype
    block_q = ref.block_rows(indices.shape[1], q_idx.shape[1] + k_idx.shape[1])
    return ref.indexer_fwd(q_idx.to(acc), k_idx.to(acc), w.to(acc), indices, scores, block_q)


indexer_fwd = torch.library.custom_op("dsa::indexer_fwd", mutates_args=())(indexer_fwd_reference)


@indexer_fwd.register_fake
def _(q_idx, k_idx, w, indices):
    return allocate(indexer_fwd_shapes(q_idx, indices), q_idx.device)[0]


@without_autocast
def indexer_bwd_reference(q_idx: Tensor, k_idx: Tensor, w: Tensor, indices: Tensor,
                          dscores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    outs = allocate(indexer_bwd_shapes(q_idx, k_idx, w), q_idx.device)
    check_index_range(indices, k_idx.shape[0])
    acc = acc_dtype(q_idx.dtype)
    q, k, wa = q_idx.to(acc), k_idx.to(acc), w.to(acc)
    dq, dk, dw = torch.empty_like(q), torch.zeros_like(k), torch.empty_like(wa)
    block_q = ref.block_rows(indices.shape[1], q_idx.shape[1] + k_idx.shape[1])
    ref.indexer_bwd(q, k, wa, indices, dscores.to(acc), dq, dk, dw, block_q)
    for out, grad in zip(outs, (dq, dk, dw)):
        out.copy_(grad)
    return outs


indexer_bwd = torch.library.custom_op("dsa::indexer_bwd", mutates_args=())(indexer_bwd_reference)


@indexer_bwd.register_fake
def _(q_idx, k_idx, w, indices, dscores):
    return allocate(indexer_bwd_shapes(q_idx, k_idx, w), q_idx.device)


def _setup_context(ctx, inputs, output):
    q_idx, k_idx, w, indices = inputs
    ctx.save_for_backward(q_idx, k_idx, w, indices)
    ctx.set_materialize_grads(False)


def _backward(ctx, dscores):
    if dscores is None:
        return None, None, None, None
    q_idx, k_idx, w, indices = ctx.saved_tensors
    dq_idx, dk_idx, dw = torch.ops.dsa.indexer_bwd(q_idx, k_idx, w, indices, dscores)
    return dq_idx, dk_idx, dw, None


indexer_fwd.register_autograd(_backward, setup_context=_setup_context)
