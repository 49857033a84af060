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

On CUDA the forward can run the TileLang kernel ``csrc_tl.dsa_indexer_loss`` (the target and
each row's KL in one pass over the selected keys, no per-head probabilities in HBM; the op sums
the rows): q and kv bf16 or fp16 of one dtype, fp32 ``lse``, scores in fp32 (bf16 / fp16 are
read as fp32), int32 indices, ``(D_qk, H)`` with a variant
(``csrc_tl.dsa_indexer_loss.config_for``), an sm_90 GPU.  There an index at or past ``T_kv``
is not rejected (that would read the indices on the host) but counts as an empty slot, as in
the other DSA kernels.  It is opt-in (:data:`LOSS_KERNEL_SWITCH` set to 1) until
its GPU tests (tests/test_tl_dsa_indexer_loss.py -m cuda) pass on main.  The backward is
elementwise (``softmax(scores) - p``) and runs its PyTorch kernel everywhere.
"""
import os

from torch import Tensor
import torch

from ...ops.chunked import without_autocast
from ...ops.tilelang_path import KERNEL_DTYPES, tilelang_usable
from ..reference import loss as ref
from ..reference.layout import check_index_range
from ..reference.sparse_mla import block_rows as attention_block_rows
from .kernels import aligned as _aligned
from .kernels import kernel_for
from .shapes import acc_dtype, allocate, indexer_loss_bwd_shapes, indexer_loss_fwd_shapes

#: Environment variable that lets ``indexer_loss_fwd`` run its TileLang kernel ("1").
LOSS_KERNEL_SWITCH = "TORCH_DPLR_DSA_TILELANG_LOSS"


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


def _tilelang_kernel(scores: Tensor, q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor):
    """The TileLang kernel of this call, or None (the PyTorch kernel runs): opted in, q and kv
    bf16 or fp16 of one dtype, scores bf16 / fp16 / fp32, fp32 lse, int32 indices, at least one
    token and slot, a variant for ``(D_qk, H)``, an sm_90 GPU.  Shapes, dtypes and the device
    only: no tensor value is read."""
    applies = (os.environ.get(LOSS_KERNEL_SWITCH) == "1" and q.dtype in KERNEL_DTYPES
               and kv.dtype == q.dtype and scores.dtype in (*KERNEL_DTYPES, torch.float32)
               and lse.dtype == torch.float32 and indices.dtype == torch.int32
               and q.shape[0] and indices.shape[1] and tilelang_usable(q.device))
    if not applies:
        return None
    from csrc_tl.dsa_indexer_loss import config_for  # TileLang is importable (checked above)

    config = config_for(q.shape[2], q.shape[1], q.dtype)
    return None if config is None else kernel_for("dsa_indexer_loss", config)


@indexer_loss_fwd.register_kernel("cuda")
@without_autocast
def indexer_loss_fwd_cuda(scores, q, kv, indices, lse, scale, coeff, reduction):
    _check_reduction(reduction)
    kernel = _tilelang_kernel(scores, q, kv, indices, lse)
    if kernel is None:
        return indexer_loss_fwd_reference(scores, q, kv, indices, lse, scale, coeff, reduction)
    loss, target = allocate(indexer_loss_fwd_shapes(scores), scores.device)
    # per row: its KL and whether it has a valid slot; summed here, in a fixed order
    rows = torch.empty(scores.shape[0], 2, dtype=torch.float32, device=scores.device)
    kernel(_aligned(q), _aligned(kv), indices.contiguous(), lse.contiguous(),
           scores.to(torch.float32).contiguous(), float(scale), target, rows)
    total = rows[:, 0].sum()
    if reduction == "mean":
        total = total / rows[:, 1].sum().clamp(min=1)
    loss.copy_(total * float(coeff))
    return loss, target


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
