"""The indexer's KL loss over the selected keys (DeepSeek-V3.2 §2.1, sparse training stage).

Per query row ``t`` with at least one valid slot:

    p[t, j]  = mean_h exp(scale · q[t, h] · kv[indices[t, j]] - lse[t, h]), renormalized
    KL[t]    = Σ_j p[t, j] · (log max(p[t, j], 1e-10) - log_softmax_j(scores[t, :]))
    loss     = coeff · Σ_t KL[t] / max(#valid rows, 1)      (reduction "mean")
               coeff · Σ_t KL[t]                            (reduction "sum")

Softmaxes run over a row's valid slots only.  ``p`` (the head-averaged main attention over the
selected keys) is a constant: formed from ``lse`` one block of queries at a time, never as
every head's full probabilities, and only the scores get a gradient:
``dscores = dloss · coeff / denom · (softmax(scores) - p)`` on valid slots.
"""
from __future__ import annotations

import torch

EPS = 1e-10  # the floor under p inside the log (Megatron-LM's INDEXER_LOSS_EPS)
REDUCTIONS = ("mean", "sum")


def target(q, kv, indices, lse, scale: float, out, block_q: int) -> torch.Tensor:
    """Writes ``p [T, k]`` (0 on slots of -1) into ``out``; inputs in the compute dtype."""
    T, H = q.shape[:2]
    for t0 in range(0, T, block_q):
        t1 = min(T, t0 + block_q)
        idx = indices[t0:t1].long()
        valid = idx >= 0
        keys = kv[idx.clamp(min=0)]
        logits = torch.einsum("bhd,bkd->bhk", q[t0:t1], keys) * scale
        probs = torch.where(valid[:, None, :], torch.exp(logits - lse[t0:t1, :, None]), 0)
        p = probs.sum(dim=1) / H
        out[t0:t1] = p / p.sum(dim=-1, keepdim=True).clamp(min=EPS)
    return out


def _log_softmax(scores, valid):
    if scores.shape[-1] == 0:  # no slot at all (k = 0): amax has nothing to reduce
        return torch.zeros_like(scores)
    masked = scores.masked_fill(~valid, float("-inf"))
    m = masked.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0)
    shifted = masked - m
    total = torch.exp(shifted).sum(dim=-1, keepdim=True)
    log_z = torch.log(total.clamp(min=torch.finfo(total.dtype).tiny))
    return torch.where(valid, shifted - log_z, 0)


def _denominator(valid_rows, reduction: str):
    if reduction == "sum":
        return valid_rows.new_ones(())
    return valid_rows.sum().clamp(min=1)


def kl_loss(scores, p, indices, coeff: float, reduction: str) -> torch.Tensor:
    """The loss (0-dim, the dtype of ``scores``) from the scores and the target ``p``."""
    valid = indices >= 0
    log_q = _log_softmax(scores, valid)
    terms = torch.where(valid, p * (torch.log(p.clamp(min=EPS)) - log_q), 0)
    valid_rows = valid.any(dim=-1).to(scores.dtype)
    return coeff * terms.sum() / _denominator(valid_rows, reduction)


def kl_loss_bwd(scores, p, indices, dloss, coeff: float, reduction: str) -> torch.Tensor:
    """``dscores`` of :func:`kl_loss` (0 on slots of -1)."""
    valid = indices >= 0
    softmax = torch.exp(_log_softmax(scores, valid))
    valid_rows = valid.any(dim=-1).to(scores.dtype)
    factor = dloss * coeff / _denominator(valid_rows, reduction)
    return torch.where(valid, (softmax - p) * factor, 0)
