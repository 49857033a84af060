"""Sparse MLA attention over selected keys (absorbed MLA: one latent row per token).

    logits[t, h, j] = scale · q[t, h] · kv[indices[t, j]]          (valid slots only)
    lse[t, h]       = log Σ_j exp(logits[t, h, j])                  (-inf: no valid slot)
    o[t, h]         = Σ_j exp(logits[t, h, j] - lse[t, h]) · kv[indices[t, j], :D_v]

A row with no valid slot gets ``o = 0`` and ``lse = -inf`` (the log of an empty sum).  The
backward is the usual one with ``delta = rowsum(do · o) - dlse``:
``dlogits = P · (do · v - delta)``; ``dq = scale · dlogits · kv``; ``dkv`` gathers
``scale · dlogitsᵀ q`` (every column) plus ``Pᵀ do`` (the value columns) by ``index_add_``.
"""
from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 22


def block_rows(topk: int, heads: int, dim: int) -> int:
    """Queries per block: the gathered ``[block, k, D]`` and ``[block, H, k]`` logits stay
    near ``BLOCK_ELEMENTS`` elements."""
    return max(1, min(1024, BLOCK_ELEMENTS // max(1, topk * (dim + 2 * heads))))


def _block(q, kv, indices, t0, t1, scale):
    idx = indices[t0:t1].long()
    valid = idx >= 0
    keys = kv[idx.clamp(min=0)]                                  # [b, k, D]
    logits = torch.einsum("bhd,bkd->bhk", q[t0:t1], keys) * scale
    return idx, valid, keys, logits.masked_fill_(~valid[:, None, :], float("-inf"))


def sparse_mla_fwd(q, kv, indices, scale: float, d_v: int, o, lse, block_q: int):
    """``q [T, H, D]``, ``kv [T, D]`` in the compute dtype; writes ``o [T, H, d_v]`` and
    ``lse [T, H]``."""
    if indices.shape[1] == 0:  # no slot at all: every row is the empty sum (amax has no identity)
        o.zero_()
        lse.fill_(float("-inf"))
        return
    T = q.shape[0]
    for t0 in range(0, T, block_q):
        t1 = min(T, t0 + block_q)
        _, _, keys, logits = _block(q, kv, indices, t0, t1, scale)
        m = logits.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0)       # rows without a valid slot
        p = torch.exp(logits - m)
        denom = p.sum(dim=-1)
        out = torch.einsum("bhk,bkd->bhd", p, keys[..., :d_v])
        o[t0:t1] = out / denom.clamp(min=torch.finfo(denom.dtype).tiny)[..., None]
        lse[t0:t1] = torch.where(denom > 0, m[..., 0] + torch.log(denom), float("-inf"))


def sparse_mla_bwd(q, kv, indices, o, lse, do, dlse, scale: float, d_v: int, dq, dkv,
                   block_q: int):
    """Writes ``dq`` and accumulates ``dkv`` (zeroed by the caller), compute dtype."""
    T = q.shape[0]
    for t0 in range(0, T, block_q):
        t1 = min(T, t0 + block_q)
        idx, valid, keys, logits = _block(q, kv, indices, t0, t1, scale)
        row_lse = lse[t0:t1, :, None]
        p = torch.where(valid[:, None, :], torch.exp(logits - row_lse), 0)
        do_blk = do[t0:t1]
        dp = torch.einsum("bhd,bkd->bhk", do_blk, keys[..., :d_v])
        delta = (do_blk * o[t0:t1]).sum(dim=-1) - dlse[t0:t1]
        dlogits = p * (dp - delta[..., None])
        dq[t0:t1] = torch.einsum("bhk,bkd->bhd", dlogits, keys) * scale
        dkeys = torch.einsum("bhk,bhd->bkd", dlogits, q[t0:t1]) * scale
        dkeys[..., :d_v] += torch.einsum("bhk,bhd->bkd", p, do_blk)
        dkv.index_add_(0, idx[valid], dkeys[valid])
