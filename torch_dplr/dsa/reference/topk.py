"""Top-k key selection by lightning-indexer score, in blocks of queries and keys.

    score[t, s] = Σ_h w[t, h] · ReLU(q_idx[t, h] · k_idx[s])     for visible keys s

Per block of queries, the scores of one block of keys at a time are merged into a running
top-k, so memory is ``block_q · (H_idx · block_k + topk)`` whatever ``T`` is.  Ties go to the
smaller key position: candidates are kept in position order and ranked with a stable sort, so
the result equals the first ``topk`` entries of a stable descending sort of the dense row.
"""
from __future__ import annotations

import torch

from .layout import key_starts

# Elements of the largest per-block intermediate (the per-head scores [block_q, H_idx, block_k]).
BLOCK_ELEMENTS = 1 << 22
BLOCK_K = 1024
MAX_BLOCK_Q = 256


def block_sizes(num_index_heads: int, topk: int) -> tuple[int, int]:
    """``(block_q, block_k)`` of the op's kernel: the per-block buffers stay near
    ``BLOCK_ELEMENTS`` elements, independent of ``T``."""
    block_q = BLOCK_ELEMENTS // (max(num_index_heads, 1) * BLOCK_K + topk)
    return max(1, min(MAX_BLOCK_Q, block_q)), BLOCK_K


def index_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[Q, S]`` scores of queries ``q_idx [Q, H, D]`` (weights ``w [Q, H]``) against keys
    ``k_idx [S, D]``, every pair (no mask)."""
    per_head = torch.einsum("qhd,sd->qhs", q_idx, k_idx).relu_()
    return torch.einsum("qhs,qh->qs", per_head, w)


def _merge(best_s, best_p, scores, positions, topk):
    """Keep the ``topk`` best of the running set and a new block (positions ascending in both,
    the running set's below the block's), ties to the smaller position."""
    cand_s = torch.cat([best_s, scores], dim=1)
    cand_p = torch.cat([best_p, positions.expand(scores.shape[0], -1)], dim=1)
    order = torch.sort(cand_s, dim=1, descending=True, stable=True).indices[:, :topk]
    best_s, best_p = cand_s.gather(1, order), cand_p.gather(1, order)
    # back to position order, so that the next merge breaks ties the same way
    perm = torch.sort(best_p, dim=1, stable=True).indices
    return best_s.gather(1, perm), best_p.gather(1, perm)


def _finalize(best_s, best_p, T):
    """Selected positions ascending, ``-1`` (slots without a visible key) after them."""
    key = torch.where(torch.isneginf(best_s), torch.full_like(best_p, T), best_p)
    key = torch.sort(key, dim=1).values
    return torch.where(key == T, torch.full_like(key, -1), key)


def indexer_topk(q_idx, k_idx, w, cu_seqlens, topk: int, out: torch.Tensor,
                 block_q: int, block_k: int, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Writes the ``[T, topk]`` selected key positions into ``out`` (int32) and returns it.

    ``q_idx``, ``k_idx``, ``w`` are already in the compute dtype; ``starts`` (from
    :func:`~.layout.key_starts`) may be passed when the caller has it.
    """
    T = q_idx.shape[0]
    device = q_idx.device
    if starts is None:
        starts = key_starts(cu_seqlens, T, device)
    starts_host = starts.tolist()
    for t0 in range(0, T, block_q):
        t1 = min(T, t0 + block_q)
        rows = torch.arange(t0, t1, device=device)[:, None]
        row_starts = starts[t0:t1, None]
        best_s = q_idx.new_full((t1 - t0, topk), float("-inf"))
        best_p = torch.full((t1 - t0, topk), -1, dtype=torch.int64, device=device)
        # keys visible to some row of the block: [first row's start, last row]
        for s0 in range(starts_host[t0], t1, block_k):
            s1 = min(t1, s0 + block_k)
            positions = torch.arange(s0, s1, device=device)
            scores = index_scores(q_idx[t0:t1], k_idx[s0:s1], w[t0:t1])
            visible = (positions >= row_starts) & (positions <= rows)
            scores = scores.masked_fill_(~visible, float("-inf"))
            best_s, best_p = _merge(best_s, best_p, scores, positions[None], topk)
        out[t0:t1] = _finalize(best_s, best_p, T)
    return out
