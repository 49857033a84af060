"""``dsa::indexer_loss_fwd`` / ``dsa::indexer_loss_bwd``: the indexer's KL loss.

Schemas:

- ``indexer_loss_fwd(Tensor scores, Tensor q, Tensor kv, Tensor indices, Tensor lse,
  float scale, float coeff, str reduction) -> (Tensor loss, Tensor target)``
- ``indexer_loss_bwd(Tensor scores, Tensor target, Tensor indices, Tensor dloss, float coeff,
  str reduction) -> Tensor dscores``

``scores [T, k]`` (from ``dsa::indexer_fwd``), ``q [T, H, D_qk]``, ``kv [T, D_qk]``,
``indices [T, k]`` int32 and ``lse [T, H]`` (from ``dsa::sparse_mla_fwd``).  ``loss`` is 0-dim,
``target [T, k]`` the head-averaged main attention over the selected keys (the KL's ``p``, kept
for the backward); both fp32 (fp64 for fp64 scores).  ``reduction`` is ``"mean"`` (over query
rows with at least one valid slot) or ``"sum"``.  Only ``scores`` gets a gradient: ``q``,
``kv`` and ``lse`` make a constant target, and ``target`` itself is not differentiable.
"""
from torch import Tensor
import torch

from ...ops.chunked import without_autocast
from ..reference import loss as ref
from ..reference.layout import check_index_range
from ..reference.sparse_mla import block_rows as attention_block_rows
from .shapes import acc_dtype, allocate, indexer_loss_bwd_shapes, indexer_loss_fwd_shapes


def _check_reduction(reduction):
    if reduction not in ref.REDUCTIONS:
        raise ValueError(f"reduction must be one of {ref.REDUCTIONS}, got {reduction!r}")


@without_autocast
def indexer_loss_fwd_reference(scores: Tensor, q: Tensor, kv: Tensor, indices: Tensor,
                               lse: Tensor, scale: float, coeff: float, reduction: str
                               ) -> tuple[Tensor, Tensor]:
    loss, p = allocate(indexer_loss_fwd_shapes(scores), scores.device)
    _check_reduction(reduction)
    check_index_range(indices, kv.shape[0])
    acc = p.dtype
    block_q = attention_block_rows(indices.shape[1], q.shape[1], q.shape[2])
    ref.target(q.to(acc), kv.to(acc), indices, lse.to(acc), float(scale), p, block_q)
    loss.copy_(ref.kl_loss(scores.to(acc), p, indices, float(coeff), reduction))
    return loss, p


indexer_loss_fwd = torch.library.custom_op("dsa::indexer_loss_fwd", mutates_args=())(
    indexer_loss_fwd_reference)


@indexer_loss_fwd.register_fake
def _(scores, q, kv, indices, lse, scale, coeff, reduction):
    return allocate(indexer_loss_fwd_shapes(scores), scores.device)


@without_autocast
def indexer_loss_bwd_reference(scores: Tensor, target: Tensor, indices: Tensor, dloss: Tensor,
                               coeff: float, reduction: str) -> Tensor:
    (dscores,) = allocate(indexer_loss_bwd_shapes(scores), scores.device)
    _check_reduction(reduction)
    acc = acc_dtype(scores.dtype)
    dscores.copy_(ref.kl_loss_bwd(scores.to(acc), target.to(acc), indices, dloss.to(acc),
                                  float(coeff), reduction))
    return dscores


indexer_loss_bwd = torch.library.custom_op("dsa::indexer_loss_bwd", mutates_args=())(
    indexer_loss_bwd_reference)


@indexer_loss_bwd.register_fake
def _(scores, target, indices, dloss, coeff, reduction):
    return allocate(indexer_loss_bwd_shapes(scores), scores.device)[0]


def _setup_context(ctx, inputs, output):
    scores, q, kv, indices, lse, scale, coeff, reduction = inputs
    _, target = output
    ctx.mark_non_differentiable(target)
    ctx.save_for_backward(scores, target, indices)
    ctx.config = (coeff, reduction)
    ctx.set_materialize_grads(False)


def _backward(ctx, dloss, dtarget):
    # dtarget: the target is a constant of the loss, never differentiated
    if dloss is None:
        return (None,) * 8
    scores, target, indices = ctx.saved_tensors
    coeff, reduction = ctx.config
    dscores = torch.ops.dsa.indexer_loss_bwd(scores, target, indices, dloss, coeff, reduction)
    return (dscores,) + (None,) * 7


indexer_loss_fwd.register_autograd(_backward, setup_context=_setup_context)
