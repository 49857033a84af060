"""``dsa::indexer_topk``: the ``topk`` best keys of every query by lightning-indexer score.

Schema: ``indexer_topk(Tensor q_idx, Tensor k_idx, Tensor w, Tensor cu_seqlens, int topk)
-> Tensor indices``.  ``q_idx [T, H_idx, D_idx]`` and ``k_idx [T, D_idx]`` of one dtype, ``w
[T, H_idx]`` any float dtype, ``cu_seqlens [N+1]`` int32/int64 or the size-0 sentinel (one
sequence).  ``indices [T, topk]`` int32: positions in the packed token axis, ascending, then
``-1`` in the slots left when fewer than ``topk`` keys are visible; ties go to the smaller
position.  Scores are computed in fp32 (fp64 for fp64 inputs), in blocks of queries and keys.

Not differentiable (integer output): the selected scores get their gradient through
``dsa::indexer_fwd``.

On CUDA the op runs the TileLang kernel ``csrc_tl.dsa_indexer_topk`` (the index scores and the
selection fused: no ``[T, T]`` tensor) where one is built (:func:`_tilelang_kernel`: ``q_idx``
and ``k_idx`` bf16 or fp16 of one dtype, ``(H_idx, D_idx)`` in its ``DIMS``, an sm_90 GPU).
There ``cu_seqlens`` is not checked on the host (that would sync): a malformed one selects
within whatever key ranges it implies, never outside ``[0, t]``.  Its scores are the same sum
in another order (tensor-core products), so a key whose score is within fp32 rounding of a
row's k-th score may be chosen where the PyTorch kernel chose another; with equal scores the
two agree exactly, ties included.  :data:`TOPK_KERNEL_SWITCH` set to 0 keeps the PyTorch kernel
there too.  Everything else runs the PyTorch kernel.
"""

from torch import Tensor
import torch

from ...ops.chunked import without_autocast
from ...ops.tilelang_path import KERNEL_DTYPES, tilelang_usable
from ..reference import topk as ref
from ..reference.layout import checked_key_starts, key_starts
from .kernels import aligned as _aligned
from .kernels import kernel_for, switched_off
from .shapes import acc_dtype, allocate, indexer_topk_shapes


@without_autocast
def indexer_topk_reference(q_idx: Tensor, k_idx: Tensor, w: Tensor, cu_seqlens: Tensor,
                           topk: int) -> Tensor:
    (indices,) = allocate(indexer_topk_shapes(q_idx, topk), q_idx.device)
    T, H_idx = q_idx.shape[:2]
    starts = checked_key_starts(cu_seqlens, T, q_idx.device)
    acc = acc_dtype(q_idx.dtype)
    block_q, block_k = ref.block_sizes(H_idx, topk)
    return ref.indexer_topk(q_idx.to(acc), k_idx.to(acc), w.to(acc), cu_seqlens, topk, indices,
                            block_q, block_k, starts)


# Registered for every device; on CUDA :func:`indexer_topk_cuda` decides per call.
indexer_topk = torch.library.custom_op("dsa::indexer_topk", mutates_args=())(indexer_topk_reference)


@indexer_topk.register_fake
def _(q_idx, k_idx, w, cu_seqlens, topk):
    return allocate(indexer_topk_shapes(q_idx, topk), q_idx.device)[0]


def _tilelang_kernel(q_idx: Tensor, k_idx: Tensor, topk: int):
    """The TileLang kernel of this call, or None (the PyTorch kernel runs): q_idx and k_idx bf16
    or fp16 of one dtype, at least one token, ``topk >= 1``, a variant built for ``(H_idx, D_idx)``
    (``csrc_tl.dsa_indexer_topk.config_for``), an sm_90 GPU.  Shapes, dtypes and the device
    only: no tensor value is read."""
    T = q_idx.shape[0]
    if not (q_idx.dtype in KERNEL_DTYPES and k_idx.dtype == q_idx.dtype and T and topk >= 1
            and tilelang_usable(q_idx.device)):
        return None
    from csrc_tl.dsa_indexer_topk import config_for  # TileLang is importable (checked above)

    config = config_for(q_idx.shape[1], q_idx.shape[2], q_idx.dtype)
    return None if config is None else kernel_for("dsa_indexer_topk", config)


#: Environment variable that keeps ``indexer_topk`` on its PyTorch kernel ("0").
TOPK_KERNEL_SWITCH = "TORCH_DPLR_DSA_TILELANG_TOPK"


@indexer_topk.register_kernel("cuda")
@without_autocast
def indexer_topk_cuda(q_idx, k_idx, w, cu_seqlens, topk):
    kernel = None
    if not switched_off(TOPK_KERNEL_SWITCH):
        kernel = _tilelang_kernel(q_idx, k_idx, topk)
    if kernel is None:
        return indexer_topk_reference(q_idx, k_idx, w, cu_seqlens, topk)
    (indices,) = allocate(indexer_topk_shapes(q_idx, topk), q_idx.device)
    T = q_idx.shape[0]
    # each token's first visible key, on the device (T + 1 past cu_seqlens[-1]: no key)
    starts = key_starts(cu_seqlens, T, q_idx.device).clamp_(0, T).to(torch.int32)
    kernel(_aligned(q_idx), _aligned(k_idx), _aligned(w.to(torch.float32)), starts, indices)
    return indices


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


def _backward(ctx, grad):
    # the selection is piecewise constant: no gradient into its inputs
    return None, None, None, None, None


indexer_topk.register_autograd(_backward, setup_context=_setup_context)
