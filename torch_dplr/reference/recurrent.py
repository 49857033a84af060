"""Per-token recurrence in plain PyTorch (decode and short sequences), vectorized over sequences.

    S_t = diag(exp(gk_t)) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ,   o_t = scale · S_tᵀ q_t

Inputs are token-major per sequence ``[N, L, H, D]`` (zero rows past a sequence's end are
no-ops, see layout.py).  The backward keeps every state of the forward sweep, which is what
makes this path suitable for short sequences only.
"""
from __future__ import annotations

import torch


def _step(S, g_t, a_t, b_t, k_t, v_t):
    n_t = (a_t[..., None] * S).sum(-2)
    return torch.exp(g_t)[..., None] * S + b_t[..., None] * n_t[..., None, :] \
        + k_t[..., None] * v_t[..., None, :], n_t


def recurrent_fwd(q, k, v, a, b, g, h0, scale: float):
    S = h0.clone()
    o = torch.zeros_like(v)
    for t in range(q.shape[1]):
        S, _ = _step(S, g[:, t], a[:, t], b[:, t], k[:, t], v[:, t])
        o[:, t] = scale * (q[:, t, ..., None] * S).sum(-2)
    return o, S


def recurrent_bwd(q, k, v, a, b, g, h0, scale: float, do, dht):
    """Returns (dq, dk, dv, da, db, dg, dh0)."""
    L = q.shape[1]
    states, news = [h0], []
    for t in range(L):
        S, n_t = _step(states[-1], g[:, t], a[:, t], b[:, t], k[:, t], v[:, t])
        states.append(S)
        news.append(n_t)
    dq, dk, dv, da, db, dg = (torch.zeros_like(x) for x in (q, k, v, a, b, g))
    dS = dht.clone()
    for t in reversed(range(L)):
        S, S_prev, n_t = states[t + 1], states[t], news[t]
        dS = dS + scale * q[:, t, ..., None] * do[:, t, ..., None, :]
        dq[:, t] = scale * (S * do[:, t, ..., None, :]).sum(-1)
        dk[:, t] = (dS * v[:, t, ..., None, :]).sum(-1)
        dv[:, t] = (dS * k[:, t, ..., None]).sum(-2)
        db[:, t] = (dS * n_t[..., None, :]).sum(-1)
        dn = (dS * b[:, t, ..., None]).sum(-2)
        da[:, t] = (S_prev * dn[..., None, :]).sum(-1)
        decay = torch.exp(g[:, t])
        dg[:, t] = decay * (S_prev * dS).sum(-1)
        dS = decay[..., None] * dS + a[:, t, ..., None] * dn[..., None, :]
    return dq, dk, dv, da, db, dg, dS
