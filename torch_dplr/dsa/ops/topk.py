"""``dsa::indexer_topk``: the ``topk`` best keys of every query by lightning-indexer score.

Schema: ``indexer_topk(Tensor q_idx, Tensor k_idx, Tensor w, Tensor cu_seqlens, int topk)
-> Tensor indices``.  ``q_idx [T, H_idx, D_idx]`` and ``k_idx [T, D_idx]`` of one dtype, ``w
[T, H_idx]`` any float dtype, ``cu_seqlens [N+1]`` int32/int64 or the size-0 sentinel (one
sequence).  ``indices [T, topk]`` int32: positions in the packed token axis, ascending, then
``-1`` in the slots left when fewer than ``topk`` keys are visible; ties go to the smaller
position.  Scores are computed in fp32 (fp64 for fp64 inputs), in blocks of queries and keys.

Not differentiable (integer output): the selected scores get their gradient through
``dsa::indexer_fwd``.
"""
from torch import Tensor
import torch

from ...ops.chunked import without_autocast
from ..reference import topk as ref
from ..reference.layout import checked_key_starts
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


# Registered for every device: on CUDA it runs until a GPU kernel is registered
# (``indexer_topk.register_kernel("cuda")``), with this schema.
indexer_topk = torch.library.custom_op("dsa::indexer_topk", mutates_args=())(indexer_topk_reference)


@indexer_topk.register_fake
def _(q_idx, k_idx, w, cu_seqlens, topk):
    return allocate(indexer_topk_shapes(q_idx, topk), q_idx.device)[0]


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


def _backward(ctx, grad):
    # the selection is piecewise constant: no gradient into its inputs
    return None, None, None, None, None


indexer_topk.register_autograd(_backward, setup_context=_setup_context)
