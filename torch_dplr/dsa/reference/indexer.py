"""Lightning-indexer scores at selected keys, and their gradients.

    scores[t, j] = Σ_h w[t, h] · ReLU(q_idx[t, h] · k_idx[indices[t, j]])    (-inf where
    indices[t, j] = -1)

Blocks of queries gather their selected keys ``[block, k, D_idx]``; the backward scatters the
key gradients back with ``index_add_``.
"""
from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 22


def block_rows(topk: int, width: int) -> int:
    """Queries per block so that a gathered ``[block, topk, width]`` stays near
    ``BLOCK_ELEMENTS`` elements."""
    return max(1, min(1024, BLOCK_ELEMENTS // max(1, topk * width)))


def _gather(k_idx, idx):
    valid = idx >= 0
    return k_idx[idx.clamp(min=0)], valid


def indexer_fwd(q_idx, k_idx, w, indices, out, block_q: int) -> torch.Tensor:
    """``q_idx [T, H, D]``, ``k_idx [T, D]``, ``w [T, H]`` in the compute dtype; writes the
    ``[T, k]`` scores into ``out``."""
    T = q_idx.shape[0]
    for t0 in range(0, T, block_q):
        t1 = min(T, t0 + block_q)
        keys, valid = _gather(k_idx, indices[t0:t1].long())
        per_head = torch.einsum("bhd,bkd->bhk", q_idx[t0:t1], keys).relu_()
        scores = torch.einsum("bhk,bh->bk", per_head, w[t0:t1])
        out[t0:t1] = scores.masked_fill_(~valid, float("-inf"))
    return out


def indexer_bwd(q_idx, k_idx, w, indices, dscores, dq_idx, dk_idx, dw, block_q: int):
    """Gradients of :func:`indexer_fwd`: writes ``dq_idx``, ``dw`` and accumulates ``dk_idx``
    (all in the compute dtype, ``dk_idx`` zeroed by the caller).  Slots of ``-1`` carry none."""
    T = q_idx.shape[0]
    for t0 in range(0, T, block_q):
        t1 = min(T, t0 + block_q)
        idx = indices[t0:t1].long()
        keys, valid = _gather(k_idx, idx)
        q, w_blk = q_idx[t0:t1], w[t0:t1]
        dots = torch.einsum("bhd,bkd->bhk", q, keys)
        ds = torch.where(valid, dscores[t0:t1], 0)
        dw[t0:t1] = torch.einsum("bk,bhk->bh", ds, dots.relu())
        # d dots = ds · w, through the ReLU (zero gradient at 0, as torch.relu)
        ddots = torch.where(dots > 0, ds[:, None, :] * w_blk[:, :, None], 0)
        dq_idx[t0:t1] = torch.einsum("bhk,bkd->bhd", ddots, keys)
        dkeys = torch.einsum("bhk,bhd->bkd", ddots, q)
        dk_idx.index_add_(0, idx[valid], dkeys[valid])
