"""Intra-chunk stage backward: (dq, dk, da, db, dgk) from the gradients of the intra outputs.

Contract: ``torch_dplr.ops.intra.chunk_intra_bwd_reference`` (math in
``torch_dplr.reference.intra.intra_bwd``). Per chunk of C rows (local i, j),
per feature column, with gi / ge the inclusive / exclusive gate cumsums in log2
units (``ge_i = gi_{i-1}``, ``ge_0 = 0``) and gl = gi at the chunk's last row:

    dq_i = scale sum_{j<=i} (dA_qk_ij k_j + dA_qb_ij b_j) 2^(gi_i-gi_j) + scale dqg_i 2^gi_i
    da_i =       sum_{j<i}  (dA_ak_ij k_j + dA_ab_ij b_j) 2^(ge_i-gi_j) + dag_i 2^ge_i
    dk_j = sum_{i>=j} scale dA_qk_ij q_i 2^(gi_i-gi_j) + sum_{i>j} dA_ak_ij a_i 2^(ge_i-gi_j)
           + dkg_j 2^(gl-gi_j)                      (db_j: the same with dA_qb, dA_ab, dbg)
    dgk_i = sum_{r>=i} (q dq - k dk - b db)_r + sum_{r>i} (a da)_r
            + log2(e) dgl + sum_r 2^(gl-gi_r) (k dkg + b dbg)_r

(the reference's ``LOG2E * (rev(dgi) + rev(dge) - dge + dgl_total)`` with the ln2 /
log2e factors cancelled; dq..db here are the totals). The masked upper parts of
the dA matrices are zeroed on load, so whatever they hold is ignored.

Grid and tiles
--------------
One CTA per (K-block, head, chunk slot, batch), 128 threads, grid
``(K/block_K * H, slots, B)``; columns are independent, so K is cut into ``block_K``
wide blocks (default 64). A CTA loads its chunk's
q, k, a, b, gate rows (zero past the sequence end), the four C x C dA tiles (masked,
cast to the GEMM operand dtype), recomputes gi by a per-column serial cumsum in
shared memory, computes the matrix terms on tensor cores, adds the elementwise
terms while storing dq/da/dk/db, and accumulates the per-row dgk terms in a
shared fp32 tile ``G`` (``a da`` of row i is added to row i-1, which turns the
exclusive sum into an inclusive one). A final per-column serial pass (one
thread per column) does the in-chunk reverse cumsum and writes dgk.
One variant for rect and varlen: the kernel always sees a list of sequences (B == 1
at call time; a rect batch comes flattened, ``torch_dplr.ops.varlen.as_one_sequence_list``)
and one CTA per chunk slot of ``torch_dplr.ops.varlen.kernel_tables`` (``chunk_start`` /
``chunk_len``; an empty slot loads nothing and stores nothing).

Exponent schemes (DESIGN.md section 1, numerics)
------------------------------------------------
``bounded=True``: one centre per column, c = gl/2, and every decay factored as
``2^(x_i - c) 2^(c - y_j)``: four C x C x BK GEMMs per side (wgmma at C = 64).
The largest exponent is |gl|/2 <= C |lower_bound| log2(e) / 2; :func:`select_scheme`
licenses the scheme only where that stays within the GEMM operand dtype's range
(bf16 operands: <= 100; fp16 operands: <= 8, e.g. RWKV-7's bound at C = 16 only).

``bounded=False`` (any gate, all exponents <= 0): 16-row sub-blocks. Stage
I = 0..C/16 uses P = gi at row 16I-1 as the pivot for every pair that straddles
it: the off-diagonal part of sub-block row I is
``2^(gi_i - P) (dA[I, <16I] @ (k 2^(P - gi)))`` and the off-diagonal part of
sub-block column I-1 is ``2^(P - gi_j) (dA[>=16I, I-1]^T @ (q 2^(gi - P)))``
(M = 16 mma GEMMs). The 16 x 16 diagonal blocks run on CUDA cores as an exact
Horner recurrence over the per-row decays ``d_r = 2^(log2e gk_r) <= 1``
(``2^(gi_i - gi_j) = d_{j+1} ... d_i``): no exponent at all, one lane per
(row, column), warp-uniform trip counts, no cross-lane reduction.

Operands and precision: GEMM operands are in the input dtype (bf16 or fp16),
accumulation fp32; the fp32 dA_ak / dA_ab are rounded to the input dtype (for
fp16 this assumes |dA_ak|, |dA_ab| < 65504). Elementwise terms, the
row / column factors, the diagonal blocks and the dgk sums are fp32. dgk is a
difference of large terms: each (i, j) pair enters once through its row (q dq,
a da) and once through its column (k dk, b db), and the two cancel in every
dgk_r with r <= j. The kernel therefore forms the GEMM part of those products as
``rounded operand x GEMM result`` (e.g. ``Y1 * F_row`` for ``q dq``, where the
column GEMM used that same Y1), so the pair cancels exactly as in the fp32
reference, instead of leaving bf16 noise of the size of the cancelled terms
(measured on reference-pipeline gradients: dgk error 0.019 -> 0.002 for the
bounded scheme at C = 64). In the sub-block scheme this holds for pairs in the
same or adjacent sub-blocks (non-adjacent pairs carry decays over >= 16 steps).

Shared memory (BK = block_K): raw q/k/a/b 8 C BK bytes, gi 4 C BK (+4 C BK decays and
2 x 16 BK x 4 diagonal-block tiles, unbounded), dA tiles 8 C^2, GEMM operands 8 C BK,
G + t-terms 8 C BK. As built (BK = 64, TileLang's liveness-based reuse, any K):
C = 64: 129 KB bounded, 168 KB unbounded (1 CTA/SM); C = 32: 56 / 72 KB; C = 16:
26 / 30 KB. Registers 54-136, no spills. No async-copy pipelining: one chunk per
CTA, loads are plain predicated vector loads; latency is hidden by co-resident CTAs
where shared memory allows (block_K = 32 halves the C = 64 footprint).

Shapes: q, k, a, b, dqg, dkg, dag, dbg, dq, dk, da, db [B, T, H, K] dtype;
gk, dgk [B, T, H, K] gk_dtype; dgl [B, S, H, K] fp32 (S chunk slots);
dA_qk, dA_qb [B, T, H, C] dtype; dA_ak, dA_ab [B, T, H, C] fp32; scale is a
runtime fp32 scalar; chunk_start, chunk_len int32 [S]. B, T, H, S are symbolic (B == 1
at call time). Signature (call ``kernel(*inputs, *outputs)``, nothing returned)::

    intra_bwd(q, k, a, b, gk, dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg,
              chunk_start, chunk_len, scale, dq, dk, da, db, dgk)
"""

# no "from __future__ import annotations": the prim_func annotations must evaluate eagerly
# (they name factory arguments that the function body does not reference)

import itertools
import math

import tilelang.language as T

from .compile import canonical_dtype, kernel_options

__all__ = [
    "intra_bwd_kernel",
    "select_scheme",
    "max_centred_exponent",
    "ref_program",
    "variants",
    "CHUNK_SIZES",
    "HEAD_DIMS",
    "DTYPES",
]

CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")

_SUB = 16  # sub-block rows of the unbounded scheme (one mma tile)
_ACC = "float32"
_LOG2E = 1.4426950408889634

#: Largest |exponent| of a centred GEMM operand each operand dtype tolerates.
#: bf16 has fp32's range: 2^100 leaves 2^27 for data magnitudes and C-term sums.
#: fp16 tops out at 65504 = 2^16: 2^8 leaves 2^8 for the data.
_CENTRED_EXPONENT_LIMIT = {"bfloat16": 100.0, "float16": 8.0}


def max_centred_exponent(C: int, lower_bound: float) -> float:
    """Largest |exponent| of the bounded scheme's operands: ``C |lower_bound| log2(e) / 2``."""
    return C * abs(lower_bound) * _LOG2E / 2


def select_scheme(C: int, dtype, lower_bound: float | None) -> bool:
    """``bounded`` for :func:`intra_bwd_kernel`: True only where ``lower_bound`` licenses it.

    ``lower_bound`` is the declared gate floor (natural log, <= 0); None or -inf means
    unbounded gates, which always take the exact sub-block scheme.
    """
    if lower_bound is None or not math.isfinite(lower_bound):
        return False
    limit = _CENTRED_EXPONENT_LIMIT[canonical_dtype(dtype)]
    return max_centred_exponent(C, lower_bound) <= limit


@kernel_options(pass_configs=None)
def intra_bwd_kernel(
    C: int,
    K: int,
    dtype: str,
    gk_dtype: str = "float32",
    bounded: bool = False,
    block_K: int = 0,
    threads: int = 0,
):
    """prim_func ``intra_bwd`` for one config (see the module docstring for the call).

    C: chunk size (16, 32, 64); K: head dim (multiple of block_K); dtype: bf16 / fp16
    (q, k, a, b, their gradients, dA_qk, dA_qb, GEMM operands); gk_dtype: dtype of gk
    and dgk (fp32 or dtype); bounded: exponent scheme (see :func:`select_scheme`).
    Schedule knobs (same results): block_K (0: 64) and threads (0: 128).
    """
    dtype = canonical_dtype(dtype)
    gk_dtype = canonical_dtype(gk_dtype)
    if C not in CHUNK_SIZES:
        raise ValueError(f"chunk size C={C} not in {CHUNK_SIZES}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if gk_dtype not in ("float32", dtype):
        raise ValueError(f"gk_dtype={gk_dtype}: must be float32 or dtype={dtype}")
    BK = block_K or min(K, 64)
    threads = threads or 128
    if BK % 16 or K % BK or BK > 128:
        raise ValueError(f"block_K={BK}: need a multiple of 16, <= 128, dividing K={K}")
    if threads % 32 or threads % BK or (_SUB * BK) % threads or threads < BK:
        raise ValueError(f"threads={threads} must be a multiple of block_K={BK} dividing 16*block_K")
    NK = K // BK
    nb = C // _SUB
    NG = threads // BK  # lanes per column in the diagonal-block recurrences
    op = dtype  # GEMM operand dtype

    B, Tn, H, S = T.dynamic("B, T, H, S")

    # ------------------------------------------------------------------ helpers
    def mat_term(F, S_, i, c, factor, use_gemm, use_diag):
        """Matrix part of one output element: F * factor (GEMM) + S (diagonal block)."""
        v = T.float32(0)
        if use_gemm:
            v = F[i, c] * factor
        if use_diag:
            v = v + S_[i, c]
        return v

    def pair_term(F, Op, S_, x, i, r, c, use_gemm, use_diag):
        """The same matrix part times its row's own operand, for the dgk sums: the GEMM
        part multiplies the *rounded* operand the other side's GEMM used, so each (i, j)
        pair's row and column contributions cancel exactly where the reference's do."""
        v = T.float32(0)
        if use_gemm:
            v = T.Cast(_ACC, Op[r, c]) * F[i, c]
        if use_diag:
            v = v + x * S_[i, c]
        return v

    def prev_gi(gi_s, r, c):
        """ge at row r: gi of row r-1, 0 at the chunk's first row."""
        return T.if_then_else(r > 0, gi_s[T.max(r - 1, 0), c], T.float32(0))

    def load_row(x, i_b, t, i_h, kk, ok):
        return T.if_then_else(ok, T.Cast(_ACC, x[i_b, t, i_h, kk]), T.float32(0))

    @T.macro
    def row_epilogue(r0, nrows, F1, F2, piv, S1, S2, use_gemm, use_diag, Y1, Y2,
                     i_b, i_h, k0, t0, L, scale, gi_s, q_s, a_s, G_s, dqg, dag, dq, da):
        """dq, da of rows r0..r0+nrows: matrix part, elementwise terms, store, G terms.

        F1 / F2: GEMM results for these rows (factor 2^(gi - piv) / 2^(ge - piv) still to
        apply), S1 / S2: diagonal-block parts (final), Y1 / Y2: the rounded q / a operands
        decayed to piv (Y1 includes scale)."""
        for i, c in T.Parallel(nrows, BK):
            r = r0 + i
            g = gi_s[r, c]
            e = prev_gi(gi_s, r, c)
            ok = r < L
            qv = T.Cast(_ACC, q_s[r, c])
            av = T.Cast(_ACC, a_s[r, c])
            gq = load_row(dqg, i_b, t0 + r, i_h, k0 + c, ok) * T.exp2(g)
            ga = load_row(dag, i_b, t0 + r, i_h, k0 + c, ok) * T.exp2(e)
            vq = scale * (mat_term(F1, S1, i, c, T.exp2(g - piv[c]), use_gemm, use_diag) + gq)
            va = mat_term(F2, S2, i, c, T.exp2(e - piv[c]), use_gemm, use_diag) + ga
            if ok:
                dq[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, vq)
                da[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, va)
            G_s[r, c] = G_s[r, c] + pair_term(F1, Y1, S1, scale * qv, i, r, c, use_gemm, use_diag) + scale * qv * gq
            F2[i, c] = pair_term(F2, Y2, S2, av, i, r, c, use_gemm, use_diag) + av * ga
        # a_i da_i belongs to the exclusive sum, i.e. to row i-1 (separate loop: other owner)
        for i, c in T.Parallel(nrows, BK):
            r = r0 + i
            if r > 0:
                G_s[T.max(r - 1, 0), c] = G_s[T.max(r - 1, 0), c] + F2[i, c]

    @T.macro
    def col_epilogue(r0, nrows, F1, F2, piv, S1, S2, use_gemm, use_diag, X1, X2,
                     i_b, i_h, k0, t0, L, gi_s, k_s, b_s, G_s, Tt_s, dkg, dbg, dk, db):
        """dk, db of rows r0..r0+nrows: matrix part, elementwise terms, store, G and t terms.

        F1 / F2: GEMM results (factor 2^(piv - gi) still to apply), S1 / S2: diagonal-block
        parts, X1 / X2: the rounded k / b operands decayed to piv."""
        for i, c in T.Parallel(nrows, BK):
            r = r0 + i
            g = gi_s[r, c]
            ok = r < L
            f = T.exp2(piv[c] - g)
            te = T.exp2(gi_s[C - 1, c] - g)
            gk_ = load_row(dkg, i_b, t0 + r, i_h, k0 + c, ok)
            gb_ = load_row(dbg, i_b, t0 + r, i_h, k0 + c, ok)
            kv = T.Cast(_ACC, k_s[r, c])
            bv = T.Cast(_ACC, b_s[r, c])
            vk = mat_term(F1, S1, i, c, f, use_gemm, use_diag) + gk_ * te
            vb = mat_term(F2, S2, i, c, f, use_gemm, use_diag) + gb_ * te
            if ok:
                dk[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, vk)
                db[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, vb)
            t_end = te * (kv * gk_ + bv * gb_)
            G_s[r, c] = (G_s[r, c] - pair_term(F1, X1, S1, kv, i, r, c, use_gemm, use_diag)
                         - pair_term(F2, X2, S2, bv, i, r, c, use_gemm, use_diag) - t_end)
            Tt_s[r, c] = t_end

    # ------------------------------------------------------------------ kernel
    stages = tuple(range(nb + 1))

    @T.macro
    def body(q, k, a, b, gk, dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg, scale,
             dq, dk, da, db, dgk, i_kh, i_c, i_b, t0, L):
        i_k = i_kh % NK
        i_h = i_kh // NK
        k0 = i_k * BK

        q_s = T.alloc_shared((C, BK), dtype)
        k_s = T.alloc_shared((C, BK), dtype)
        a_s = T.alloc_shared((C, BK), dtype)
        b_s = T.alloc_shared((C, BK), dtype)
        gi_s = T.alloc_shared((C, BK), _ACC)
        Aqk = T.alloc_shared((C, C), op)
        Aqb = T.alloc_shared((C, C), op)
        Aak = T.alloc_shared((C, C), op)
        Aab = T.alloc_shared((C, C), op)
        X1 = T.alloc_shared((C, BK), op)  # k side operand
        X2 = T.alloc_shared((C, BK), op)  # b side operand
        Y1 = T.alloc_shared((C, BK), op)  # scale * q side operand
        Y2 = T.alloc_shared((C, BK), op)  # a side operand
        G_s = T.alloc_shared((C, BK), _ACC)
        Tt_s = T.alloc_shared((C, BK), _ACC)
        piv = T.alloc_shared((BK,), _ACC)
        acc = T.alloc_local((4,), _ACC)
        tx = T.get_thread_binding()
        col = tx % BK
        lane_row = tx // BK
        if bounded:
            F1 = T.alloc_fragment((C, BK), _ACC)
            F2 = T.alloc_fragment((C, BK), _ACC)
        else:
            d_s = T.alloc_shared((C, BK), _ACC)
            S1 = T.alloc_shared((_SUB, BK), _ACC)
            S2 = T.alloc_shared((_SUB, BK), _ACC)
            F1 = T.alloc_fragment((_SUB, BK), _ACC)
            F2 = T.alloc_fragment((_SUB, BK), _ACC)

        # ---- loads: rows past the sequence end read as zero; dA masked to its triangle
        for r, c in T.Parallel(C, BK):
            ok = r < L
            q_s[r, c] = T.if_then_else(ok, q[i_b, t0 + r, i_h, k0 + c], T.Cast(dtype, 0))
            k_s[r, c] = T.if_then_else(ok, k[i_b, t0 + r, i_h, k0 + c], T.Cast(dtype, 0))
            a_s[r, c] = T.if_then_else(ok, a[i_b, t0 + r, i_h, k0 + c], T.Cast(dtype, 0))
            b_s[r, c] = T.if_then_else(ok, b[i_b, t0 + r, i_h, k0 + c], T.Cast(dtype, 0))
            gi_s[r, c] = T.if_then_else(ok, T.Cast(_ACC, gk[i_b, t0 + r, i_h, k0 + c]), T.float32(0)) * _LOG2E
            G_s[r, c] = T.float32(0)
        for r, j in T.Parallel(C, C):
            # row condition on the load (vectorizes), triangle as a select (drops garbage, NaN too)
            ok = r < L
            vqk = T.if_then_else(ok, dA_qk[i_b, t0 + r, i_h, j], T.Cast(dtype, 0))
            vqb = T.if_then_else(ok, dA_qb[i_b, t0 + r, i_h, j], T.Cast(dtype, 0))
            vak = T.if_then_else(ok, dA_ak[i_b, t0 + r, i_h, j], T.float32(0))
            vab = T.if_then_else(ok, dA_ab[i_b, t0 + r, i_h, j], T.float32(0))
            Aqk[r, j] = T.if_then_else(j <= r, vqk, T.Cast(op, 0))
            Aqb[r, j] = T.if_then_else(j <= r, vqb, T.Cast(op, 0))
            Aak[r, j] = T.Cast(op, T.if_then_else(j < r, vak, T.float32(0)))
            Aab[r, j] = T.Cast(op, T.if_then_else(j < r, vab, T.float32(0)))
        if not bounded:
            for r, c in T.Parallel(C, BK):
                d_s[r, c] = T.exp2(gi_s[r, c])  # per-row decay 2^(log2e gk) <= 1
        T.sync_threads()
        # ---- gi: inclusive cumsum down each column (one thread per column)
        if tx < BK:
            acc[0] = T.float32(0)
            for r in T.serial(C):
                acc[0] = acc[0] + gi_s[r, tx]
                gi_s[r, tx] = acc[0]
        T.sync_threads()


        if bounded:
            # ---- one centre per column: c = gl / 2
            for c in T.Parallel(BK):
                piv[c] = gi_s[C - 1, c] * 0.5
            for r, c in T.Parallel(C, BK):
                g = gi_s[r, c]
                e = T.if_then_else(r > 0, gi_s[T.max(r - 1, 0), c], T.float32(0))
                fx = T.exp2(piv[c] - g)
                X1[r, c] = T.Cast(op, T.Cast(_ACC, k_s[r, c]) * fx)
                X2[r, c] = T.Cast(op, T.Cast(_ACC, b_s[r, c]) * fx)
                Y1[r, c] = T.Cast(op, scale * T.Cast(_ACC, q_s[r, c]) * T.exp2(g - piv[c]))
                Y2[r, c] = T.Cast(op, T.Cast(_ACC, a_s[r, c]) * T.exp2(e - piv[c]))
            T.gemm(Aqk, X1, F1, clear_accum=True)
            T.gemm(Aqb, X2, F1)
            T.gemm(Aak, X1, F2, clear_accum=True)
            T.gemm(Aab, X2, F2)
            row_epilogue(0, C, F1, F2, piv, None, None, True, False, Y1, Y2, i_b, i_h, k0, t0, L, scale, gi_s, q_s, a_s, G_s, dqg, dag, dq, da)
            T.gemm(Aqk, Y1, F1, transpose_A=True, clear_accum=True)
            T.gemm(Aak, Y2, F1, transpose_A=True)
            T.gemm(Aqb, Y1, F2, transpose_A=True, clear_accum=True)
            T.gemm(Aab, Y2, F2, transpose_A=True)
            col_epilogue(0, C, F1, F2, piv, None, None, True, False, X1, X2, i_b, i_h, k0, t0, L, gi_s, k_s, b_s, G_s, Tt_s, dkg, dbg, dk, db)
        else:
            for I in stages:  # unrolled at trace time
                lo = _SUB * I  # first row of sub-block I; pivot P = gi[lo - 1]
                if 1 <= I < nb:  # pivot and operands of the GEMMs straddling row lo
                    for c in T.Parallel(BK):
                        piv[c] = gi_s[lo - 1, c]
                    for r, c in T.Parallel(lo, BK):  # rows before the pivot
                        fx = T.exp2(piv[c] - gi_s[r, c])
                        X1[r, c] = T.Cast(op, T.Cast(_ACC, k_s[r, c]) * fx)
                        X2[r, c] = T.Cast(op, T.Cast(_ACC, b_s[r, c]) * fx)
                    for r_, c in T.Parallel(C - lo, BK):  # rows after the pivot
                        r = lo + r_
                        Y1[r, c] = T.Cast(op, scale * T.Cast(_ACC, q_s[r, c]) * T.exp2(gi_s[r, c] - piv[c]))
                        Y2[r, c] = T.Cast(op, T.Cast(_ACC, a_s[r, c]) * T.exp2(gi_s[r - 1, c] - piv[c]))
                if I < nb:
                    # ---- sub-block row I: dq, da
                    if I >= 1:
                        T.gemm(Aqk[lo : lo + _SUB, 0:lo], X1[0:lo, :], F1, clear_accum=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        T.gemm(Aqb[lo : lo + _SUB, 0:lo], X2[0:lo, :], F1, policy=T.GemmWarpPolicy.FullCol)
                        T.gemm(Aak[lo : lo + _SUB, 0:lo], X1[0:lo, :], F2, clear_accum=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        T.gemm(Aab[lo : lo + _SUB, 0:lo], X2[0:lo, :], F2, policy=T.GemmWarpPolicy.FullCol)
                    # diagonal block, Horner over j = lo..i:  acc = acc * d_j + w_ij
                    for s in T.serial(_SUB // NG):
                        il = lane_row + s * NG
                        i = lo + il
                        acc[0] = T.float32(0)
                        acc[1] = T.float32(0)
                        for jl in T.serial(il):
                            j = lo + jl
                            dj = d_s[j, col]
                            kj = T.Cast(_ACC, k_s[j, col])
                            bj = T.Cast(_ACC, b_s[j, col])
                            acc[0] = acc[0] * dj + (T.Cast(_ACC, Aqk[i, j]) * kj + T.Cast(_ACC, Aqb[i, j]) * bj)
                            acc[1] = acc[1] * dj + (T.Cast(_ACC, Aak[i, j]) * kj + T.Cast(_ACC, Aab[i, j]) * bj)
                        acc[0] = acc[0] * d_s[i, col] + (T.Cast(_ACC, Aqk[i, i]) * T.Cast(_ACC, k_s[i, col])
                                                         + T.Cast(_ACC, Aqb[i, i]) * T.Cast(_ACC, b_s[i, col]))
                        S1[il, col] = acc[0]
                        S2[il, col] = acc[1]
                    row_epilogue(lo, _SUB, F1, F2, piv, S1, S2, I >= 1, True, Y1, Y2, i_b, i_h, k0, t0, L, scale, gi_s, q_s, a_s, G_s, dqg, dag, dq, da)
                if I >= 1:
                    # ---- sub-block column I-1: dk, db
                    jo = lo - _SUB
                    if I < nb:
                        T.gemm(Aqk[lo:C, jo:lo], Y1[lo:C, :], F1, transpose_A=True, clear_accum=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        T.gemm(Aak[lo:C, jo:lo], Y2[lo:C, :], F1, transpose_A=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        T.gemm(Aqb[lo:C, jo:lo], Y1[lo:C, :], F2, transpose_A=True, clear_accum=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        T.gemm(Aab[lo:C, jo:lo], Y2[lo:C, :], F2, transpose_A=True,
                               policy=T.GemmWarpPolicy.FullCol)
                    # diagonal block, Horner over i = jo+15 .. j (descending):
                    # q side (i >= j): acc = acc * d_{i+1} + scale dA_qk_ij q_i
                    # a side (i >  j): acc = acc * d_i     + dA_ak_ij a_i
                    for s in T.serial(_SUB // NG):
                        jl = lane_row + s * NG
                        j = jo + jl
                        for u in T.serial(4):
                            acc[u] = T.float32(0)
                        for m in T.serial(_SUB - 1 - jl):
                            i = jo + _SUB - 1 - m
                            di = d_s[i, col]
                            dn = T.if_then_else(m > 0, d_s[T.min(i + 1, C - 1), col], T.float32(0))
                            qi = T.Cast(_ACC, q_s[i, col])
                            ai = T.Cast(_ACC, a_s[i, col])
                            acc[0] = acc[0] * dn + T.Cast(_ACC, Aqk[i, j]) * qi
                            acc[1] = acc[1] * dn + T.Cast(_ACC, Aqb[i, j]) * qi
                            acc[2] = acc[2] * di + T.Cast(_ACC, Aak[i, j]) * ai
                            acc[3] = acc[3] * di + T.Cast(_ACC, Aab[i, j]) * ai
                        dn = T.if_then_else(jl < _SUB - 1, d_s[T.min(j + 1, C - 1), col], T.float32(0))
                        qj = T.Cast(_ACC, q_s[j, col])
                        acc[0] = acc[0] * dn + T.Cast(_ACC, Aqk[j, j]) * qj
                        acc[1] = acc[1] * dn + T.Cast(_ACC, Aqb[j, j]) * qj
                        S1[jl, col] = scale * acc[0] + acc[2]
                        S2[jl, col] = scale * acc[1] + acc[3]
                    col_epilogue(jo, _SUB, F1, F2, piv, S1, S2, I < nb, True, X1, X2, i_b, i_h, k0, t0, L, gi_s, k_s, b_s, G_s, Tt_s, dkg, dbg, dk, db)
        T.sync_threads()

        # ---- dgk: reverse cumsum of G down each column, plus the chunk-wide constant
        if tx < BK:
            acc[0] = T.float32(0)
            for r in T.serial(C):
                acc[0] = acc[0] + Tt_s[r, tx]
            acc[0] = acc[0] + dgl[i_b, i_c, i_h, k0 + tx] * _LOG2E
            acc[1] = T.float32(0)
            for m in T.serial(C):
                r = C - 1 - m
                acc[1] = acc[1] + G_s[r, tx]
                if r < L:
                    dgk[i_b, t0 + r, i_h, k0 + tx] = T.Cast(gk_dtype, acc[1] + acc[0])

    @T.prim_func
    def intra_bwd(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        a: T.Tensor((B, Tn, H, K), dtype),
        b: T.Tensor((B, Tn, H, K), dtype),
        gk: T.Tensor((B, Tn, H, K), gk_dtype),
        dgl: T.Tensor((B, S, H, K), _ACC),
        dA_qk: T.Tensor((B, Tn, H, C), dtype),
        dA_qb: T.Tensor((B, Tn, H, C), dtype),
        dA_ak: T.Tensor((B, Tn, H, C), _ACC),
        dA_ab: T.Tensor((B, Tn, H, C), _ACC),
        dqg: T.Tensor((B, Tn, H, K), dtype),
        dkg: T.Tensor((B, Tn, H, K), dtype),
        dag: T.Tensor((B, Tn, H, K), dtype),
        dbg: T.Tensor((B, Tn, H, K), dtype),
        chunk_start: T.Tensor((S,), "int32"),
        chunk_len: T.Tensor((S,), "int32"),
        scale: T.float32,
        dq: T.Tensor((B, Tn, H, K), dtype),
        dk: T.Tensor((B, Tn, H, K), dtype),
        da: T.Tensor((B, Tn, H, K), dtype),
        db: T.Tensor((B, Tn, H, K), dtype),
        dgk: T.Tensor((B, Tn, H, K), gk_dtype),
    ):
        with T.Kernel(NK * H, S, B, threads=threads) as (i_kh, i_c, i_b):
            t0 = chunk_start[i_c]
            L = chunk_len[i_c]
            body(q, k, a, b, gk, dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg, scale,
                 dq, dk, da, db, dgk, i_kh, i_c, i_b, t0, L)

    return intra_bwd


def variants():
    """Every config the dispatch can build (the compile test builds them all, the GPU test
    runs them): C x K x dtype x scheme x gate dtype (gk and dgk in fp32, or the input dtype)."""
    for C, K, dt, bounded in itertools.product(CHUNK_SIZES, HEAD_DIMS, DTYPES, (True, False)):
        for gk_dtype in ("float32", dt):
            yield dict(C=C, K=K, dtype=dt, gk_dtype=gk_dtype, bounded=bounded)


def ref_program(q, k, a, b, gk, cu_seqlens, dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg,
                scale, chunk_size):
    """The PyTorch kernel with this kernel's contract: (dq, dk, da, db, dgk)."""
    from torch_dplr.ops.intra import chunk_intra_bwd_reference

    return chunk_intra_bwd_reference(q, k, a, b, gk, cu_seqlens, dgl, dA_qk, dA_qb, dA_ak, dA_ab,
                                     dqg, dkg, dag, dbg, scale, chunk_size, float("-inf"))
