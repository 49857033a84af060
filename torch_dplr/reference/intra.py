"""Intra-chunk stage in plain PyTorch: gated q/k/a/b and the four intra-chunk matrices.

Tensors here are chunk-major ``[n, H, C, D]`` in the compute dtype.  Decay factors use exact
pairwise exponents ``2^(gi_i - gi_j)`` with ``j <= i`` (masked before exp2), so every
exponent is <= 0: exact and finite for any gate, bounded or not.  Work is sliced over
chunks to keep the ``[n, H, C, C, K]`` factor tensor small.
"""
from __future__ import annotations

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_SLICE_ELEMS = 1 << 24


def gate_cumsums(g: torch.Tensor):
    """Natural-log gates ``[n, H, C, K]`` -> (gi inclusive, ge exclusive) in log2 units."""
    gi = torch.cumsum(g, dim=2) * LOG2E
    return gi, gi - g * LOG2E


def pair_decay(row_exp: torch.Tensor, col_exp: torch.Tensor, strict: bool) -> torch.Tensor:
    """``E[n,h,i,j,k] = 2^(row_i - col_j)`` on ``j <= i`` (``j < i`` if strict), else 0."""
    C = row_exp.shape[2]
    keep = torch.ones(C, C, dtype=torch.bool, device=row_exp.device).tril(-1 if strict else 0)
    diff = row_exp[:, :, :, None, :] - col_exp[:, :, None, :, :]
    return torch.exp2(diff.masked_fill(~keep[:, :, None], float("-inf")))


def chunk_slices(n: int, H: int, C: int, K: int):
    step = max(1, _SLICE_ELEMS // max(1, H * C * C * K))
    return [slice(s, min(n, s + step)) for s in range(0, n, step)]


def intra_fwd(q, k, a, b, g, scale: float):
    """Chunk-major inputs -> (gl [n,H,K], A_qk, A_qb, A_ak, A_ab [n,H,C,C], qg, kg, ag, bg)."""
    n, H, C, K = q.shape
    gi, ge = gate_cumsums(g)
    gl = gi[:, :, -1]
    A = [q.new_empty(n, H, C, C) for _ in range(4)]
    for s in chunk_slices(n, H, C, K):
        qe = q[s, :, :, None, :] * pair_decay(gi[s], gi[s], strict=False)
        ae = a[s, :, :, None, :] * pair_decay(ge[s], gi[s], strict=True)
        A[0][s] = scale * torch.einsum("nhijk,nhjk->nhij", qe, k[s])
        A[1][s] = scale * torch.einsum("nhijk,nhjk->nhij", qe, b[s])
        A[2][s] = torch.einsum("nhijk,nhjk->nhij", ae, k[s])
        A[3][s] = torch.einsum("nhijk,nhjk->nhij", ae, b[s])
    to_end = torch.exp2(gl[:, :, None, :] - gi)
    return (gl, *A, scale * q * torch.exp2(gi), k * to_end, a * torch.exp2(ge), b * to_end)


def intra_bwd(q, k, a, b, g, scale: float, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg, dgl):
    """Vector-Jacobian product of :func:`intra_fwd`; returns (dq, dk, da, db, dg)."""
    n, H, C, K = q.shape
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    dA_qk, dA_qb = dA_qk * incl, dA_qb * incl
    dA_ak, dA_ab = dA_ak * incl.tril(-1), dA_ab * incl.tril(-1)
    gi, ge = gate_cumsums(g)
    gl = gi[:, :, -1]
    dq, dk, da, db = (torch.zeros_like(x) for x in (q, k, a, b))
    dgi_col = torch.zeros_like(q)  # d/dgi through the column (j) side of the matrices
    for s in chunk_slices(n, H, C, K):
        e1 = pair_decay(gi[s], gi[s], strict=False)
        e2 = pair_decay(ge[s], gi[s], strict=True)
        dq[s] = scale * torch.einsum("nhij,nhijk,nhjk->nhik", dA_qk[s], e1, k[s]) \
            + scale * torch.einsum("nhij,nhijk,nhjk->nhik", dA_qb[s], e1, b[s])
        da[s] = torch.einsum("nhij,nhijk,nhjk->nhik", dA_ak[s], e2, k[s]) \
            + torch.einsum("nhij,nhijk,nhjk->nhik", dA_ab[s], e2, b[s])
        qe = q[s, :, :, None, :] * e1
        ae = a[s, :, :, None, :] * e2
        dk_qk = scale * torch.einsum("nhijk,nhij->nhjk", qe, dA_qk[s])
        db_qb = scale * torch.einsum("nhijk,nhij->nhjk", qe, dA_qb[s])
        dk_ak = torch.einsum("nhijk,nhij->nhjk", ae, dA_ak[s])
        db_ab = torch.einsum("nhijk,nhij->nhjk", ae, dA_ab[s])
        dk[s] = dk_qk + dk_ak
        db[s] = db_qb + db_ab
        dgi_col[s] = -LN2 * (k[s] * dk[s] + b[s] * db[s])
    # Row sides of the matrices: d2^(gi_i - .) / dgi_i = ln2 * value.
    dgi = LN2 * q * dq + dgi_col
    dge = LN2 * a * da
    # Elementwise gated tensors.
    qg_scale, ag_scale = torch.exp2(gi), torch.exp2(ge)
    to_end = torch.exp2(gl[:, :, None, :] - gi)
    dq = dq + scale * dqg * qg_scale
    dgi = dgi + LN2 * scale * q * qg_scale * dqg
    da = da + dag * ag_scale
    dge = dge + LN2 * a * ag_scale * dag
    dk = dk + dkg * to_end
    db = db + dbg * to_end
    t_end = LN2 * to_end * (k * dkg + b * dbg)
    dgi = dgi - t_end
    dgl = dgl + t_end.sum(dim=2)
    # gi = log2e * cumsum(g), ge = gi - log2e * g, gl = gi[last]: chain back to g.
    rev = lambda x: torch.flip(torch.cumsum(torch.flip(x, [2]), 2), [2])  # noqa: E731
    dg = LOG2E * (rev(dgi) + rev(dge) - dge + dgl[:, :, None, :])
    return dq, dk, da, db, dg
