"""The backward of one tile (:mod:`csrc_triton.dplr_tile`): every input gradient of the tile
and the state gradient at its start, from the inputs, the tile's start state ``h``, ``do`` and
the state gradient at its end ``dh``; the forward terms are recomputed on chip.

The chain, in reverse (natural-log gate units in the gradients: ``d 2^G / dG_e = 2^G``)::

    dv_new = A_qbᵀ do + bg dh             dqg = do hᵀ    dA_qk = do vᵀ    dA_qb = do v_newᵀ
    dv     = A_qkᵀ do + kg dh             dkg = v dhᵀ    dbg = v_new dhᵀ
    dh_in  = 2^Gl dh + qgᵀ do + wᵀ dv_new                dw  = dv_new hᵀ
    dX = Ainvᵀ dv_new   dA_ak = dX vᵀ   dv += A_akᵀ dX    dag = Ainvᵀ dw
    dA_ab = dX uᵀ + dag wᵀ
    then the A matrices and gated tiles back to q, k, a, b and the gate sums G, Ge, Gl, and
    dgk = reverse inclusive cumsum of dG + reverse exclusive cumsum of dGe + dGl.

Products with an fp32 factor from the state pass (``h``, ``dh``, ``v_new``, ``dv_new``) take
it as a hi/lo pair (with ``SPLIT``; otherwise rounded once to the data dtype, as
:func:`csrc_triton.dplr_tile.tile_state_step`); the rest run in tf32, like the intra
products.
"""
import triton
import triton.language as tl

from ._common import dot, round_to
from .dplr_tile import (centred_fits, centred_operands, col_of, dot2, key_row_factors,
                        load_rows, load_tile, split_hi_lo, tile_forward_terms)


@triton.jit
def intra_bwd_centred(dA_qk, dA_qb, dA_ak, dA_ab, q, k, a, b, G, Ge, centre, scale):
    """Gradients of the A matrices' inputs through centred products: (dq, dk, da, db)."""
    Qc, Kc, Bc, Ac = centred_operands(q, k, a, b, G, Ge, centre)
    zero = tl.zeros_like(q)
    Dq = (dot(dA_qk, Kc, zero) + dot(dA_qb, Bc, zero)) * scale
    Dk = dot(tl.trans(dA_qk), Qc, zero) * scale + dot(tl.trans(dA_ak), Ac, zero)
    Db = dot(tl.trans(dA_qb), Qc, zero) * scale + dot(tl.trans(dA_ab), Ac, zero)
    Da = dot(dA_ak, Kc, zero) + dot(dA_ab, Bc, zero)
    c = centre[None, :]
    down = tl.exp2(c - G)
    return Dq * tl.exp2(G - c), Dk * down, Da * tl.exp2(Ge - c), Db * down


@triton.jit
def intra_bwd_pairwise(dA_qk, dA_qb, dA_ak, dA_ab, q, k, a, b, G, Ge, scale, BT: tl.constexpr):
    """The same gradients with exact pairwise exponents, one key row ``j`` at a time."""
    rows = tl.arange(0, BT)
    dq = tl.zeros_like(q)
    dk = tl.zeros_like(q)
    da = tl.zeros_like(q)
    db = tl.zeros_like(q)
    for j in range(BT):
        kj, bj, e_incl, e_strict = key_row_factors(k, b, G, Ge, rows, j)
        qk_j = col_of(dA_qk, rows, j)[:, None] * scale
        qb_j = col_of(dA_qb, rows, j)[:, None] * scale
        ak_j = col_of(dA_ak, rows, j)[:, None]
        ab_j = col_of(dA_ab, rows, j)[:, None]
        dq += (qk_j * kj + qb_j * bj) * e_incl
        da += (ak_j * kj + ab_j * bj) * e_strict
        qe = q * e_incl
        ae = a * e_strict
        row = rows[:, None] == j
        dk = tl.where(row, dk + tl.sum(qk_j * qe + ak_j * ae, axis=0)[None, :], dk)
        db = tl.where(row, db + tl.sum(qb_j * qe + ab_j * ae, axis=0)[None, :], db)
    return dq, dk, da, db


@triton.jit
def state_grad_step(dh, qg, bg, w, A_qb, do_d, Gl, valid, dtype: tl.constexpr,
                    SPLIT: tl.constexpr):
    """The state-gradient part of a tile's backward: (dv_new, dh_in) from the gradient ``dh``
    of the state leaving the tile (fp32 ``[K, BV]``, value columns separable), with
    ``dv_new = A_qbᵀ do + bg dh`` and ``dh_in = 2^Gl dh + qgᵀ do + wᵀ dv_new``."""
    dh_hi, dh_lo = split_hi_lo(dh, dtype, SPLIT)
    dv_new = dot2(bg, dh_hi, dh_lo, dot(tl.trans(A_qb), do_d, tl.zeros_like(do_d.to(tl.float32))),
                  SPLIT)
    dv_new = tl.where(valid[:, None], dv_new, 0.0)
    dvn_hi, dvn_lo = split_hi_lo(dv_new, dtype, SPLIT)
    dh_in = dh * tl.exp2(Gl)[:, None]
    dh_in = dot(tl.trans(qg), do_d, dh_in)
    dh_in = dot2(tl.trans(w), dvn_hi, dvn_lo, dh_in, SPLIT)
    return dv_new, dh_in


@triton.jit
def tile_backward(q, k, a, b, v, g, do, h, dh, valid, scale, dtype: tl.constexpr,
                  EXACT: tl.constexpr, BT: tl.constexpr, SPLIT: tl.constexpr = True):
    """(dq, dk, dv, da, db, dgk, dh_in) of one tile; ``g`` in log2 units, rows >= L zero."""
    rows = tl.arange(0, BT)
    incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    (qg, kg, bg, w, u, A_qk, A_qb, Gl, Ainv, A_ak, A_ab, ag, G, Ge,
     centre) = tile_forward_terms(q, k, a, b, v, g, scale, dtype, EXACT, BT)
    h_hi, h_lo = split_hi_lo(h, dtype, SPLIT)
    dh_hi, dh_lo = split_hi_lo(dh, dtype, SPLIT)
    v_d = v.to(dtype)
    do_d = do.to(dtype)
    zero_k = tl.zeros_like(q)
    zero_v = tl.zeros_like(v)
    zero_c = tl.zeros([BT, BT], dtype=tl.float32)
    v_new = tl.where(valid[:, None], dot2(w, h_hi, h_lo, u.to(tl.float32), SPLIT), 0.0)
    vn_hi, vn_lo = split_hi_lo(v_new, dtype, SPLIT)

    # ---- the state pass: o = qg h + A_qk v + A_qb v_new, h' = 2^Gl h + kgᵀ v + bgᵀ v_new
    dv_new, dh_in = state_grad_step(dh, qg, bg, w, A_qb, do_d, Gl, valid, dtype, SPLIT)
    dqg = dot2(do_d, tl.trans(h_hi), tl.trans(h_lo), zero_k, SPLIT)
    dA_qk = tl.where(incl, dot(do_d, tl.trans(v_d), zero_c), 0.0)
    dA_qb = tl.where(incl, dot2(do_d, tl.trans(vn_hi), tl.trans(vn_lo), zero_c, SPLIT), 0.0)
    dv = dot2(kg, dh_hi, dh_lo, dot(tl.trans(A_qk), do_d, zero_v), SPLIT)
    dkg = dot2(v_d, tl.trans(dh_hi), tl.trans(dh_lo), zero_k, SPLIT)
    dbg = dot(v_new, tl.trans(dh), zero_k)
    dGl = tl.sum(h * dh, axis=1) * tl.exp2(Gl)

    # ---- WY: v_new = u + w h, u = Ainv (A_ak v), w = Ainv ag
    dw = dot(dv_new, tl.trans(h), zero_k)
    dX = dot(tl.trans(Ainv), dv_new, zero_v)
    dA_ak = tl.where(strict, dot(dX, tl.trans(v), zero_c), 0.0)
    dv = dot(tl.trans(A_ak), dX, dv)
    dag = dot(tl.trans(Ainv), dw, zero_k)
    dA_ab = dot(dX, tl.trans(u.to(tl.float32)), zero_c)
    dA_ab = tl.where(strict, dot(dag, tl.trans(w.to(tl.float32)), dA_ab), 0.0)

    # ---- intra: the A matrices and gated tiles back to q, k, a, b and the gates
    if EXACT:
        if centred_fits(Gl, centre):
            dq, dk, da, db = intra_bwd_centred(dA_qk, dA_qb, dA_ak, dA_ab, q, k, a, b, G, Ge,
                                               centre, scale)
        else:
            dq, dk, da, db = intra_bwd_pairwise(dA_qk, dA_qb, dA_ak, dA_ab, q, k, a, b, G,
                                                Ge, scale, BT)
    else:
        dq, dk, da, db = intra_bwd_centred(dA_qk, dA_qb, dA_ak, dA_ab, q, k, a, b, G, Ge,
                                           centre, scale)
    dG = q * dq - k * dk - b * db
    dGe = a * da
    to_end = tl.exp2(Gl[None, :] - G)
    start = tl.exp2(G) * scale
    dq += start * dqg
    dk += to_end * dkg
    db += to_end * dbg
    da += tl.exp2(Ge) * dag
    kg_f = k * to_end
    bg_f = b * to_end
    dG += q * start * dqg - kg_f * dkg - bg_f * dbg
    dGe += ag * dag
    dGl += tl.sum(kg_f * dkg + bg_f * dbg, axis=0)
    from_end = tl.cumsum(dG + dGe, axis=0, reverse=True) - dGe
    dgk = tl.where(valid[:, None], from_end + dGl[None, :], 0.0)
    return dq, dk, dv, da, db, dgk, dh_in


@triton.jit
def tile_backward_stored(q, k, v, a, b, gk, do, tok, valid, i_h, H, K: tl.constexpr,
                         V: tl.constexpr, h, dh, dq, dk, dv, da, db, dgk, scale,
                         dtype: tl.constexpr, EXACT: tl.constexpr, BT: tl.constexpr,
                         SPLIT: tl.constexpr):
    """:func:`tile_backward` of the tile at ``tok`` from its inputs in HBM, its gradients
    stored there; returns the gradient of the state entering the tile."""
    q_t, k_t, a_t, b_t, g_t, v_t = load_tile(q, k, v, a, b, gk, tok, valid, i_h, H, K, V, 0, V)
    do_t = load_rows(do, tok, valid, i_h, H, V, 0, V)
    dq_t, dk_t, dv_t, da_t, db_t, dg_t, dh = tile_backward(
        q_t, k_t, a_t, b_t, v_t, g_t, do_t, h, dh, valid, scale, dtype, EXACT, BT, SPLIT)
    row_k = (tok[:, None] * H + i_h) * K + tl.arange(0, K)[None, :]
    row_v = (tok[:, None] * H + i_h) * V + tl.arange(0, V)[None, :]
    m = valid[:, None]
    tl.store(dq + row_k, round_to(dq_t, dtype), mask=m)
    tl.store(dk + row_k, round_to(dk_t, dtype), mask=m)
    tl.store(da + row_k, round_to(da_t, dtype), mask=m)
    tl.store(db + row_k, round_to(db_t, dtype), mask=m)
    tl.store(dv + row_v, round_to(dv_t, dtype), mask=m)
    tl.store(dgk + row_k, round_to(dg_t, dgk.dtype.element_ty), mask=m)
    return dh
