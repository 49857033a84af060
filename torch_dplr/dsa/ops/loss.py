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
the other DSA kernels.  The backward runs the Triton kernel ``csrc_triton.dsa_loss_bwd``
(``softmax(scores) - p`` row by row, writing nothing but ``dscores``) for scores in fp32, bf16
or fp16, an fp32 target and int32 indices, on a GPU where Triton runs; it takes an index at or
past ``T_kv`` as a valid slot whose score is -inf (what ``dsa::indexer_fwd`` writes there), so
its gradient is 0.  ``TORCH_DPLR_DSA_TILELANG_LOSS=0`` (:data:`LOSS_KERNEL_SWITCH`) keeps both
on their PyTorch kernels.
"""
from torch import Tensor
import torch

from ...ops.chunked import without_autocast
from ...ops.tilelang_path import KERNEL_DTYPES, tilelang_usable
from ...ops.triton_path import triton_usable
from ..reference import loss as ref
from ..reference.layout import check_index_range
from ..reference.sparse_mla import block_rows as attention_block_rows
from .kernels import aligned as _aligned
from .kernels import kernel_for, switched_off
from .shapes import acc_dtype, allocate, indexer_loss_bwd_shapes, indexer_loss_fwd_shapes

#: Environment variable that keeps the KL loss ops on their PyTorch kernels ("0").
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
    """The TileLang kernel of this call, or None (the PyTorch kernel runs): not switched off, q
    and kv bf16 or fp16 of one dtype, scores bf16 / fp16 / fp32, fp32 lse, int32 indices, at
    least one token and slot, a variant for ``(D_qk, H)``, an sm_90 GPU.  Shapes, dtypes and
    the device only: no tensor value is read."""
    applies = (not switched_off(LOSS_KERNEL_SWITCH) and q.dtype in KERNEL_DTYPES
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


def _triton_backward_applies(scores: Tensor, target: Tensor, indices: Tensor) -> bool:
    """``csrc_triton.dsa_loss_bwd`` runs the call: not switched off, scores fp32 / bf16 /
    fp16, an fp32 target and int32 indices of the scores' shape, Triton usable on the device.
    Shapes, dtypes and the device only."""
    return (not switched_off(LOSS_KERNEL_SWITCH)
            and scores.dtype in (*KERNEL_DTYPES, torch.float32)
            and target.dtype == torch.float32 and indices.dtype == torch.int32
            and scores.shape == target.shape == indices.shape
            and triton_usable(scores.device))


@indexer_loss_bwd.register_kernel("cuda")
@without_autocast
def indexer_loss_bwd_cuda(scores, target, indices, dloss, coeff, reduction):
    _check_reduction(reduction)
    if not _triton_backward_applies(scores, target, indices):
        return indexer_loss_bwd_reference(scores, target, indices, dloss, coeff, reduction)
    from csrc_triton import dsa_loss_bwd
    (dscores,) = allocate(indexer_loss_bwd_shapes(scores), scores.device)
    if scores.numel() == 0:
        return dscores
    factor = dloss.to(torch.float32) * float(coeff)
    if reduction == "mean":  # over the rows with a valid slot, counted on the device
        factor = factor / (indices.amax(dim=1) >= 0).sum().clamp(min=1)
    dsa_loss_bwd.launch(scores.contiguous(), target.contiguous(), indices.contiguous(),
                        factor.reshape(1), dscores)
    return dscores


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
