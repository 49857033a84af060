"""State pass in plain PyTorch: the serial walk over chunks, vectorized over sequences and heads.

Per chunk (h = state at its start):  v_new = u + w·h
    o  = qg·h + A_qk·v + A_qb·v_new
    h' = 2^gl ⊙ h + kgᵀ·v + bgᵀ·v_new
Chunk tensors are ``[slots + 1, H, C, D]``: the extra last slot is all zero and stands in for
the chunks a shorter sequence does not have (zero chunk, gl = 0: the identity on the state).
"""
from __future__ import annotations

import torch

from .intra import LN2


def _tril(x, diagonal=0):
    return x.tril(diagonal)


def state_fwd(seq_slots, qg, kg, bg, w, u, v, A_qk, A_qb, gl, h0, keep_activations: bool):
    """Returns (o, final state, h per slot or None, v_new or None), chunk-major."""
    n = qg.shape[0]
    N, steps = seq_slots.shape
    o = torch.zeros_like(v)
    v_new = torch.zeros_like(v) if keep_activations else None
    h_all = v.new_zeros(n, *h0.shape[1:]) if keep_activations else None
    h = h0.clone()
    A_qk, A_qb = _tril(A_qk), _tril(A_qb)
    for c in range(steps):
        idx = seq_slots[:, c]
        real = idx < n - 1  # the last slot is the zero chunk
        vn = u[idx] + w[idx] @ h
        o_c = qg[idx] @ h + A_qk[idx] @ v[idx] + A_qb[idx] @ vn
        o[idx[real]] = o_c[real]
        if keep_activations:
            v_new[idx[real]] = vn[real]
            h_all[idx[real]] = h[real]
        h = torch.exp2(gl[idx])[..., None] * h + kg[idx].transpose(-1, -2) @ v[idx] \
            + bg[idx].transpose(-1, -2) @ vn
    return o, h, h_all, v_new


def state_bwd(seq_slots, qg, kg, bg, w, v, A_qk, A_qb, gl, h_all, v_new, do, dht):
    """Reverse scan: dh (gradient of the state at a chunk's end) walks back to dh0.

    Returns (dqg, dkg, dbg, dw, du, dv, dA_qk, dA_qb, dgl, dh0), chunk-major.
    """
    n = qg.shape[0]
    N, steps = seq_slots.shape
    grads = {name: torch.zeros_like(x) for name, x in
             (("qg", qg), ("kg", kg), ("bg", bg), ("w", w), ("u", v_new), ("v", v),
              ("A_qk", A_qk), ("A_qb", A_qb), ("gl", gl))}
    A_qk, A_qb = _tril(A_qk), _tril(A_qb)
    dh = dht.clone()
    for c in reversed(range(steps)):
        idx = seq_slots[:, c]
        real = idx < n - 1
        h, vn, do_c, decay = h_all[idx], v_new[idx], do[idx], torch.exp2(gl[idx])
        dvn = A_qb[idx].transpose(-1, -2) @ do_c + bg[idx] @ dh
        parts = {
            "qg": do_c @ h.transpose(-1, -2),
            "A_qk": _tril(do_c @ v[idx].transpose(-1, -2)),
            "A_qb": _tril(do_c @ vn.transpose(-1, -2)),
            "v": A_qk[idx].transpose(-1, -2) @ do_c + kg[idx] @ dh,
            "kg": v[idx] @ dh.transpose(-1, -2),
            "bg": vn @ dh.transpose(-1, -2),
            "u": dvn,
            "w": dvn @ h.transpose(-1, -2),
            "gl": LN2 * decay * (h * dh).sum(-1),
        }
        for name, val in parts.items():
            grads[name][idx[real]] = val[real]
        dh = qg[idx].transpose(-1, -2) @ do_c + decay[..., None] * dh \
            + w[idx].transpose(-1, -2) @ dvn
    g = grads
    return g["qg"], g["kg"], g["bg"], g["w"], g["u"], g["v"], g["A_qk"], g["A_qb"], g["gl"], dh
