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

On CUDA the forward and the backward run the TileLang kernels ``csrc_tl.dsa_indexer_fwd`` and
``csrc_tl.dsa_indexer_bwd`` where one is built (:func:`_tilelang_kernel`: ``q_idx`` and
``k_idx`` bf16 or fp16 of one dtype, int32 indices, ``(H_idx, D_idx)`` in their ``DIMS``, an
sm_90 GPU); there an index outside ``[-1, T)`` is not rejected (that would read the indices on
the host) but counts as an empty slot.  Their scores are the same sum in another order; the
backward adds dk_idx with fp32 atomics, so its dk_idx may differ between runs by fp32
reordering error (bound in the kernel's docstring).  :data:`INDEXER_KERNEL_SWITCH` set to 0
keeps both on their PyTorch kernels.  Everything else runs the PyTorch kernel.
"""

from torch import Tensor
import torch

from ...ops.chunked import without_autocast
from ...ops.tilelang_path import KERNEL_DTYPES, tilelang_usable
from ..reference import indexer as ref
from ..reference.layout import check_index_range
from .kernels import aligned as _aligned
from .kernels import kernel_for, switched_off
from .shapes import acc_dtype, allocate, indexer_bwd_shapes, indexer_fwd_shapes

#: Environment variable that keeps ``indexer_fwd`` / ``indexer_bwd`` on their PyTorch kernels
#: ("0").
INDEXER_KERNEL_SWITCH = "TORCH_DPLR_DSA_TILELANG_INDEXER"


def _tilelang_kernel(family: str, q_idx: Tensor, k_idx: Tensor, indices: Tensor):
    """The TileLang kernel ``csrc_tl.<family>`` of this call, or None (the PyTorch kernel
    runs): the opt-out switch not set, q_idx and k_idx bf16 or fp16 of one dtype and length,
    int32 indices, at least one token and slot, a variant built for ``(H_idx, D_idx)``
    (``csrc_tl.dsa_indexer_fwd.config_for``, which the backward shares), an sm_90 GPU.  Shapes,
    dtypes and the device only: no tensor value is read."""
    applies = (q_idx.dtype in KERNEL_DTYPES and k_idx.dtype == q_idx.dtype
               and k_idx.shape[0] == q_idx.shape[0] and indices.dtype == torch.int32
               and q_idx.shape[0] and indices.shape[1] and tilelang_usable(q_idx.device))
    if not applies or switched_off(INDEXER_KERNEL_SWITCH):
        return None
    from csrc_tl.dsa_indexer_fwd import config_for  # TileLang is importable (checked above)

    config = config_for(q_idx.shape[1], q_idx.shape[2], q_idx.dtype)
    return None if config is None else kernel_for(family, config)


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


@indexer_fwd.register_kernel("cuda")
@without_autocast
def indexer_fwd_cuda(q_idx, k_idx, w, indices):
    kernel = _tilelang_kernel("dsa_indexer_fwd", q_idx, k_idx, indices)
    if kernel is None:
        return indexer_fwd_reference(q_idx, k_idx, w, indices)
    (scores,) = allocate(indexer_fwd_shapes(q_idx, indices), q_idx.device)
    kernel(_aligned(q_idx), _aligned(k_idx), _aligned(w.to(torch.float32)), _aligned(indices),
           scores)
    return scores


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


@indexer_bwd.register_kernel("cuda")
@without_autocast
def indexer_bwd_cuda(q_idx, k_idx, w, indices, dscores):
    kernel = _tilelang_kernel("dsa_indexer_bwd", q_idx, k_idx, indices)
    if kernel is None:
        return indexer_bwd_reference(q_idx, k_idx, w, indices, dscores)
    dq_idx, dk_idx, dw = allocate(indexer_bwd_shapes(q_idx, k_idx, w), q_idx.device)
    dk_acc = torch.zeros(k_idx.shape, dtype=torch.float32, device=k_idx.device)  # the atomics' sum
    dw_acc = dw if dw.dtype == torch.float32 else torch.empty(w.shape, dtype=torch.float32,
                                                              device=w.device)
    kernel(_aligned(q_idx), _aligned(k_idx), _aligned(w.to(torch.float32)), _aligned(indices),
           _aligned(dscores.to(torch.float32)), dq_idx, dk_acc, dw_acc)
    dk_idx.copy_(dk_acc)
    if dw_acc is not dw:
        dw.copy_(dw_acc)
    return dq_idx, dk_idx, dw


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
