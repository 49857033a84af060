"""Fused no-grad forward (``dplr::chunk_fwd_fused``): o and the final state straight from
q, k, v, a, b, gk in ONE kernel; no intermediate touches HBM.

Contract: the staged forward (``chunk_intra_fwd`` -> ``chunk_wy_fwd`` -> ``chunk_state_fwd``
with ``keep_activations=False``), see :func:`ref_program`. The op uses it only for calls that
need no gradient and fill the GPU (``torch_dplr/ops/fused.py`` says when); everything else runs
the staged kernels.

Grid and walk
-------------
One CTA (one warpgroup; two with ``threads=256``, which split every product's columns and the
elementwise work) per (V-block, head, sequence), the grid of ``state_fwd``. A CTA walks
its sequence's chunks in order with its K x BV slice of the state h in an fp32 accumulator
fragment. Per chunk it does, on chip, what the three staged kernels do:

    load   q, k, a, b (cp.async 16-byte rows; rows past T zero-filled), gk into G; one wait
    intra  gate scan (log2, inclusive, leading zero row: ge without a select); centred tf32
           operands in two 32-column steps: Qc, Kc, Bc -> A_qk, A_qb (tf32 mma.sync, as
           intra_fwd) -> dtype tiles; then Ac, Kc, Bc -> A_ab, A_ak -> the diagonal blocks of
           A_ab (fp32), the blocks below them and A_ak as bf16 hi/lo pairs; then qg, ag, kg,
           bg in registers, written over the raw tiles; then v's copy is issued
    WY     D = (I - Nd)^-1 by forward substitution (CUDA cores), Inv = (I + M^2)(I + M) D with
           M = D L (bf16 hi/lo 3-term products, async wgmma), Q = Inv A_ak, w = Inv ag, u = Q v
    state  v_new = u + w h;  o = qg h + A_qk v + A_qb v_new;  h' = 2^gl h + kg^T v + bg^T v_new
           (h and v_new as hi/lo pairs of the data dtype, 2 GEMMs per product)

The rounding points are the staged pipeline's: A_qk / A_qb, qg, kg, ag, bg, w and u rounded to
the data dtype, A_ab / A_ak / gl fp32, tf32 intra products, 3-term splits in the inverse, 2-term
splits of h and v_new. Only the summation order inside a GEMM may differ. On the H200 the final
state came out bitwise equal to the staged kernels' at every shape of tests/test_tl_fused_fwd.py,
and o within ``torch_dplr.testing.FUSED_VS_STAGED_TOL``.

V-blocks: the chunk-local work (intra, inverse, Q, w) does not depend on V and is recomputed
by every V-block CTA; BV = V (one CTA per (sequence, head)) is the default.

Gates: centred scheme only (a declared lower bound that licenses it, see
``csrc_tl.intra_fwd.centred_is_safe``); unbounded gates keep the staged path. A chunk whose
gates break the bound (its total decay, -gl in log2 units, past
``intra_fwd.centred_max_decay()`` in some column) is computed anyway, possibly as inf or NaN,
and sets ``flags[n, h] = 1`` (the caller zeroes ``flags``); ``torch_dplr/ops/fused.py`` then
recomputes the flagged (sequence, head) pairs exactly. One compare per column and chunk.

Masks: rows >= L of a chunk (L = rows left in the sequence) hold the next sequence's tokens
(or zeros past T). The gate scan zeroes their gates; ag, kg, bg, qg are zeroed there when the
gated tiles are written, v before its first use; A_ab / A_ak are masked to the strict lower
triangle and rows < L when staged, A_qk / A_qb to the lower triangle; v_new rows >= L are
zeroed; o rows >= L are not stored. This is the union of the masks the staged kernels apply.

Shared memory: ~30 per-chunk tiles share memory through TileLang's aggressive merge (see
_PASS_CONFIGS); 115,712 B at C = K = V = 64, exactly two CTAs per SM on the H200 (ptxas: 255
registers, a few loop-invariant spills). The peaks are the WY products and the second intra
step (see smem_estimate).

No prefetch of the next chunk (each chunk issues its loads in one burst and waits: two CTAs
per SM hide each other's loads); no warp specialization.

Signature (caller-allocated outputs, every dim but C, K, V symbolic)::

    fused_fwd(q, k, v, a, b, gk, h0, cu_seqlens, chunk_offsets, scale, o, ht, flags)

q, k, a, b [B, T, H, K] dtype; v, o [B, T, H, V] dtype; gk [B, T, H, K] gate_dtype;
h0 [N0, H, K, V] fp32 (N0 == 0: start from zero); cu_seqlens, chunk_offsets int32 [N+1]
(``torch_dplr.ops.varlen.kernel_tables``; rect batches come flattened); scale float;
ht [N, H, K, V] fp32 (always written); flags [N, H] int32 (only ever set to 1). B is 1 at
call time.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals at definition time.
import itertools

import tilelang.language as T

from .compile import canonical_dtype, kernel_options
from .intra_fwd import centred_max_decay
from .tile_macros import gate_scan_from, split, split_gemms, split_of, tf32, wgmma_join

__all__ = ["fused_fwd_kernel", "chain_ranges", "variants", "ref_program", "smem_estimate", "CHUNK_SIZES",
           "HEAD_DIMS", "DTYPES"]

CHUNK_SIZES = (64,)
HEAD_DIMS = (64,)
DTYPES = ("bfloat16", "float16")

_ACC = "float32"
_SPLIT = "bfloat16"  # hi/lo terms of fp32 x fp32 products (the inverse), as wy_fwd
_SUB = 16  # diagonal block of the triangular inverse
_NOWAIT = {"wg_wait": -1}  # issue a wgmma without waiting; T.wait_wgmma(0) joins

# Warp specialization off (the loop-carried h would be converted in producer warps, see
# state_fwd); TMA off (descriptors would be encoded on the host every launch).
# Aggressive shared-memory merge: buffers allocated at kernel scope but only touched inside the
# chunk loop get liveness per statement of the loop body, so the ~30 per-chunk tiles share
# memory (317 KB without it, over the 227 KB limit). Valid because no shared buffer carries
# data from one chunk to the next, and because no shared buffer is first written between the
# issue of an async wgmma and its join (the planner takes the issuing statement as the last
# read of the operands).
_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True,
                 "tl.enable_aggressive_shared_memory_merge": True}


def smem_estimate(C: int, K: int, BV: int) -> dict:
    """Bytes of the tiles live at the two shared-memory peaks (bf16 / fp16 data): the second
    intra step and the WY products (the larger one, ~104 KB at C = K = BV = 64); the greedy
    merged allocation adds fragmentation and alignment (115,712 B there)."""
    e, f = 2, 4
    intra = {
        "raw q k a b": 4 * e * C * K,
        "gates G (+ zero row), scan totals, gl": f * (C + 1) * K + f * 3 * K,
        "intra operands, 32 columns (fp32 x 3)": 3 * f * C * min(K, 32),
        "A_qk, A_qb (dtype)": 2 * e * C * C,
    }
    wy = {
        "gated qg kg ag bg": 4 * e * C * K,
        "v": e * C * BV,
        "A_qk, A_qb (dtype)": 2 * e * C * C,
        "A_ak hi/lo": 2 * e * C * C,
        "two hi/lo pairs of the chain (M^2, P)": 4 * e * C * C,
    }
    return {"intra step 2": intra, "WY": wy,
            "peak": max(sum(intra.values()), sum(wy.values()))}


def chain_ranges(C: int, trim: bool) -> dict:
    """Contraction range [lo, hi) of each product of the inverse chain. N = A_ab strictly lower,
    L its part below the 16 x 16 diagonal blocks (block rows >= 1, block columns <= nb - 2),
    D block diagonal; so M = D L is strictly block-lower (rows >= 16, columns < C - 16) and
    M^2 is lower by two blocks (columns < C - 32). Terms outside these ranges are exact zeros.

    >>> chain_ranges(64, True)
    {'M': (16, 64), 'P': (0, 48), 'M2': (16, 48), 'Inv': (0, 32)}
    """
    if not trim or C < 64:
        return dict(M=(0, C), P=(0, C), M2=(0, C), Inv=(0, C))
    return dict(M=(_SUB, C), P=(0, C - _SUB), M2=(_SUB, C - _SUB), Inv=(0, C - 2 * _SUB))


@kernel_options(pass_configs=_PASS_CONFIGS)
def fused_fwd_kernel(
    C: int,
    K: int,
    V: int,
    dtype: str,
    gate_dtype: str = "float32",
    BV: int = 0,
    threads: int = 128,
    min_blocks: int = 2,
    block_k: int = 16,
    trim_chain: bool = False,
    share_operands: bool = True,
    skip: str = "",
):
    """prim_func ``fused_fwd(...)`` for one config (signature in the module docstring).

    C: chunk size (64: one warpgroup, wgmma); K, V: head dims; dtype: bf16 / fp16 data;
    gate_dtype: fp32 or dtype. Schedule knobs: BV (0: V, one CTA per (sequence, head));
    threads (128: one warpgroup; 256: two, each chunk's work spread over twice the threads,
    with min_blocks 2 at 128 registers and 112 B of stack a thread on sm_90a); min_blocks (CTAs
    per SM nvcc must fit; 2 caps registers at 255 with 128 threads); block_k
    (operand columns per intra product step: smaller means smaller fp32 operand tiles);
    trim_chain (contract the inverse chain's products only over the 16-row blocks that can be
    nonzero: -37% of its tensor work; see :func:`chain_ranges`); share_operands (form the
    centred Qc, Ac, Bc, Kc once per column block and issue the four intra products together
    into four accumulators, instead of two passes that form Bc and Kc twice).  The defaults,
    one warpgroup with shared operands over 16-column blocks, were the fastest of the knobs
    at B8 T4096 H32 D64 (docs/training_dataflow.md, "Where the fused forward's time goes").

    skip: for timing only (``tools/tune_knobs.py fused_fwd:skip=wy+state``): phases of the
    chunk step left out, ``+``-separated from ``intra``, ``wy``, ``state``. The kernel then
    computes garbage; the time of the phases kept is what it measures.
    """
    skipped = set(filter(None, skip.split("+")))
    if not skipped <= {"intra", "wy", "state"}:
        raise ValueError(f"skip={skip!r}: phases are intra, wy, state")
    do_intra, do_wy, do_state = (p not in skipped for p in ("intra", "wy", "state"))
    dtype = canonical_dtype(dtype)
    gate_dtype = canonical_dtype(gate_dtype)
    if C != 64:
        raise ValueError(f"C={C}: written for C = 64 (one warpgroup, wgmma)")
    for name, d in (("K", K), ("V", V)):
        if d % 16 or not 16 <= d <= 128:
            raise ValueError(f"{name}={d}: need a multiple of 16 in [16, 128]")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if gate_dtype not in (_ACC, dtype):
        raise ValueError(f"gate_dtype={gate_dtype}: must be float32 or {dtype}")
    BV = BV or V
    if BV % 16 or V % BV:
        raise ValueError(f"BV={BV}: need a multiple of 16 dividing V={V}")
    if threads not in (128, 256):
        raise ValueError(f"threads={threads}: one or two warpgroups (128 or 256)")
    NV = V // BV
    BK = min(K, block_k)  # operand columns per intra product step
    if K % BK or BK % 8:
        raise ValueError(f"block_k={BK} must divide K={K} and be a multiple of 8")
    f32 = _ACC
    NSEG = threads // K  # row segments of the gate scan
    SL = C // NSEG
    SB = min(SL, 16)
    S = _SUB
    KR = chain_ranges(C, trim_chain)
    ddt = _SPLIT if dtype == _SPLIT else dtype  # hi/lo dtype of the products with data
    share_inv = ddt == _SPLIT  # bf16 data: Inv's bf16 pair also serves w = Inv ag

    B, Tn, H, N = T.dynamic("B, T, H, N")
    N0, N1 = T.dynamic("N0, N1")

    # ---------------- shared helpers (patterns of intra_fwd / wy_fwd / state_fwd) ----------------

    join = wgmma_join(threads)
    gemm3, gemm2 = split_gemms(_NOWAIT)  # the caller joins

    @T.macro
    def gemm3_over(Xh, Xl, Yh, Yl, acc, k_range):
        # acc += X[:, lo:hi] Y[lo:hi, :] (both split): the other columns of X / rows of Y
        # multiply exact zeros
        lo, hi = k_range
        gemm3(Xh[:, lo:hi], Xl[:, lo:hi], Yh[lo:hi, :], Yl[lo:hi, :], acc)

    def d_entry(Dd_s):
        # D[i, j] from its compact form (zero off the diagonal blocks)
        return lambda i, j: T.if_then_else(i // S == j // S, Dd_s[i, j % S], T.float32(0))

    # ---------------- stages of one chunk ----------------

    @T.macro
    def load_chunk(q, k, a, b, gk, t0, i_h, q_t, k_t, a_t, b_t, G):
        """The chunk's q, k, a, b, gk tiles in one burst (cp.async 16-byte rows, rows past T
        zero-filled), then one wait. v comes later (see the loop). Rows past L are masked where
        they are read."""
        T.async_copy(a[0, t0 : t0 + C, i_h, :], a_t)
        T.async_copy(b[0, t0 : t0 + C, i_h, :], b_t)
        T.async_copy(k[0, t0 : t0 + C, i_h, :], k_t)
        T.async_copy(q[0, t0 : t0 + C, i_h, :], q_t)
        if gate_dtype == f32:
            T.async_copy(gk[0, t0 : t0 + C, i_h, :], G[1 : C + 1, :])
        else:
            T.copy(gk[0, t0 : t0 + C, i_h, :], G[1 : C + 1, :])
        T.ptx_wait_group(0)
        T.sync_threads()

    # G[r + 1, c] = gi of row r (log2, gates past L count 0), G[0, c] = 0
    gate_scan = gate_scan_from(C, K, NSEG, SB, 1, True)

    @T.macro
    def operands_ab_ak(G, a_t, b_t, k_t, Ac, Bc, Kc, c0):
        """Centred tf32 operands of A_ab = Ac Bc^T and A_ak = Ac Kc^T for columns c0..c0+BK-1
        (as csrc_tl.intra_fwd): a 2^(ge - gm), b / k 2^(gm - gi), the centre gm = gl / 2."""
        for r, c in T.Parallel(C, BK):
            gi = G[r + 1, c0 + c]
            gm = G[C, c0 + c] * 0.5
            f = T.exp2(gm - gi)
            Ac[r, c] = tf32(T.Cast(f32, a_t[r, c0 + c]) * T.exp2(G[r, c0 + c] - gm))
            Bc[r, c] = tf32(T.Cast(f32, b_t[r, c0 + c]) * f)
            Kc[r, c] = tf32(T.Cast(f32, k_t[r, c0 + c]) * f)

    @T.macro
    def operands_qk_qb(G, q_t, b_t, k_t, Qc, Bc, Kc, c0):
        """Centred tf32 operands of A_qk = Qc Kc^T and A_qb = Qc Bc^T (columns c0..)."""
        for r, c in T.Parallel(C, BK):
            gi = G[r + 1, c0 + c]
            gm = G[C, c0 + c] * 0.5
            f = T.exp2(gm - gi)
            Qc[r, c] = tf32(T.Cast(f32, q_t[r, c0 + c]) * T.exp2(gi - gm))
            Bc[r, c] = tf32(T.Cast(f32, b_t[r, c0 + c]) * f)
            Kc[r, c] = tf32(T.Cast(f32, k_t[r, c0 + c]) * f)

    @T.macro
    def intra_products(G, X_t, Y_t, Z_t, Xc, Yc, Zc, F1, F2, operands):
        """F1 = Xc Yc^T, F2 = Xc Zc^T over K in blocks of BK columns (smaller operand tiles:
        the shared-memory peak of the kernel is here). Joined before the operands are reused."""
        for kb in range(K // BK):
            operands(G, X_t, Y_t, Z_t, Xc, Yc, Zc, kb * BK)
            T.sync_threads()
            T.gemm(Xc, Yc, F1, transpose_B=True, clear_accum=kb == 0, annotations=_NOWAIT)
            T.gemm(Xc, Zc, F2, transpose_B=True, clear_accum=kb == 0, annotations=_NOWAIT)
            join(F1, F2)

    @T.macro
    def operands_all(G, q_t, a_t, b_t, k_t, Qc, Ac, Bc, Kc, c0):
        """The centred tf32 operands of all four intra products for columns c0..c0+BK-1: those
        of A_qk / A_qb, and Ac as :func:`operands_ab_ak` forms it."""
        operands_qk_qb(G, q_t, b_t, k_t, Qc, Bc, Kc, c0)
        for r, c in T.Parallel(C, BK):
            Ac[r, c] = tf32(T.Cast(f32, a_t[r, c0 + c]) * T.exp2(G[r, c0 + c] - G[C, c0 + c] * 0.5))

    @T.macro
    def four_products(G, q_t, a_t, b_t, k_t, Qc, Ac, Bc, Kc, Fqb, Fqk, Fab, Fak):
        """A_qb, A_qk, A_ab, A_ak (unscaled, unmasked) over K in blocks of BK columns."""
        for kb in range(K // BK):
            operands_all(G, q_t, a_t, b_t, k_t, Qc, Ac, Bc, Kc, kb * BK)
            T.sync_threads()
            T.gemm(Qc, Bc, Fqb, transpose_B=True, clear_accum=kb == 0, annotations=_NOWAIT)
            T.gemm(Qc, Kc, Fqk, transpose_B=True, clear_accum=kb == 0, annotations=_NOWAIT)
            T.gemm(Ac, Bc, Fab, transpose_B=True, clear_accum=kb == 0, annotations=_NOWAIT)
            T.gemm(Ac, Kc, Fak, transpose_B=True, clear_accum=kb == 0, annotations=_NOWAIT)
            join(Fqb, Fqk)
            join(Fab, Fak)

    @T.macro
    def store_qk_qb(Fqb, Fqk, Aqk_s, Aqb_s, scale):
        for i, j in T.Parallel(C, C):
            Aqk_s[i, j] = T.Cast(dtype, T.if_then_else(j <= i, Fqk[i, j] * scale, T.float32(0)))
            Aqb_s[i, j] = T.Cast(dtype, T.if_then_else(j <= i, Fqb[i, j] * scale, T.float32(0)))

    @T.macro
    def stage_ab_ak(Fab, Fak, L, Nd_s, Lh, Ll, Akh, Akl):
        """A_ab masked (strictly lower, rows < L): diagonal blocks fp32 (forward substitution),
        the blocks below them split (L of M = D L); A_ak split."""
        for i, j in T.Parallel(C, C):
            if i // S == j // S:
                Nd_s[i, j % S] = T.if_then_else((j < i) and (i < L), Fab[i, j], T.float32(0))
        split_of(lambda i, j: T.if_then_else((i // S > j // S) and (i < L), Fab[i, j], T.float32(0)),
                 Lh, Ll)
        split_of(lambda i, j: T.if_then_else((j < i) and (i < L), Fak[i, j], T.float32(0)),
                 Akh, Akl)

    @T.macro
    def gated_tiles(L, G, q_t, k_t, a_t, b_t, Rq, Rk, Ra, Rb, scale):
        """qg = scale q 2^gi, ag = a 2^ge, kg / bg = k / b 2^(gl - gi), rows >= L zero, in
        registers, then written over the raw tiles once every thread is past them."""
        for r, c in T.Parallel(C, K):
            gi = G[r + 1, c]
            to_end = T.exp2(G[C, c] - gi)
            keep = r < L
            Rq[r, c] = T.Cast(dtype, T.if_then_else(keep, T.Cast(f32, q_t[r, c]) * scale * T.exp2(gi), T.float32(0)))
            Ra[r, c] = T.Cast(dtype, T.if_then_else(keep, T.Cast(f32, a_t[r, c]) * T.exp2(G[r, c]), T.float32(0)))
            Rk[r, c] = T.Cast(dtype, T.if_then_else(keep, T.Cast(f32, k_t[r, c]) * to_end, T.float32(0)))
            Rb[r, c] = T.Cast(dtype, T.if_then_else(keep, T.Cast(f32, b_t[r, c]) * to_end, T.float32(0)))
        T.sync_threads()
        for r, c in T.Parallel(C, K):
            q_t[r, c] = Rq[r, c]
            a_t[r, c] = Ra[r, c]
            k_t[r, c] = Rk[r, c]
            b_t[r, c] = Rb[r, c]

    @T.macro
    def block_diagonal_inverses(Nd_s, x, Dd_s):
        """D = (I - Nd)^-1, one thread per column of D, serial per lane (csrc_tl.wy_fwd).
        Nd_s holds the diagonal 16 x 16 blocks of A_ab, compact and already masked."""
        tx = T.get_thread_binding()
        if tx < C:
            r0 = (tx // S) * S
            for r in T.unroll(S):
                x[r] = T.if_then_else(r0 + r == tx, T.float32(1), T.float32(0))
                for j in T.unroll(S):
                    if j < r:
                        x[r] = x[r] + Nd_s[r0 + r, j] * x[j]
            for r in T.unroll(S):
                Dd_s[r0 + r, tx % S] = x[r]

    @T.prim_func
    def fused_fwd(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, H, V), dtype),
        a: T.Tensor((B, Tn, H, K), dtype),
        b: T.Tensor((B, Tn, H, K), dtype),
        gk: T.Tensor((B, Tn, H, K), gate_dtype),
        h0: T.Tensor((N0, H, K, V), _ACC),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        scale: T.float32,
        o: T.Tensor((B, Tn, H, V), dtype),
        ht: T.Tensor((N, H, K, V), _ACC),
        flags: T.Tensor((N, H), "int32"),
    ):
        with T.Kernel(NV, H, N, threads=threads) as (i_v, i_h, i_n):
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            v0 = i_v * BV
            bos = cu_seqlens[i_n]
            eos = cu_seqlens[i_n + 1]
            n_chunks = chunk_offsets[i_n + 1] - chunk_offsets[i_n]

            # ---- carried across chunks ----
            h_f = T.alloc_fragment((K, BV), f32)
            # ---- chunk inputs; q, k, a, b become qg, kg, ag, bg in place ----
            q_t = T.alloc_shared((C, K), dtype)
            k_t = T.alloc_shared((C, K), dtype)
            a_t = T.alloc_shared((C, K), dtype)
            b_t = T.alloc_shared((C, K), dtype)
            v_t = T.alloc_shared((C, BV), dtype)
            G = T.alloc_shared((C + 1, K), f32)  # gates -> gi, leading zero row
            Tot = T.alloc_shared((NSEG, K), f32)
            gl_s = T.alloc_shared((K,), f32)
            run = T.alloc_local((1,), f32)
            vals = T.alloc_local((SB,), f32)
            x = T.alloc_local((S,), f32)
            # ---- intra ----
            Xc = T.alloc_shared((C, BK), f32)  # Ac, then Qc
            Yc = T.alloc_shared((C, BK), f32)  # Bc
            Zc = T.alloc_shared((C, BK), f32)  # Kc
            Rq = T.alloc_fragment((C, K), dtype)
            Ra = T.alloc_fragment((C, K), dtype)
            Rk = T.alloc_fragment((C, K), dtype)
            Rb = T.alloc_fragment((C, K), dtype)
            F1 = T.alloc_fragment((C, C), f32)  # A_qb, then A_ab
            F2 = T.alloc_fragment((C, C), f32)  # A_qk, then A_ak
            Wc = F3 = F4 = None
            if share_operands:
                Wc = T.alloc_shared((C, BK), f32)  # Ac beside Qc in Xc
                F3 = T.alloc_fragment((C, C), f32)  # A_ab
                F4 = T.alloc_fragment((C, C), f32)  # A_ak
            Aqk_s = T.alloc_shared((C, C), dtype)
            Aqb_s = T.alloc_shared((C, C), dtype)
            Nd_s = T.alloc_shared((C, S), f32)  # diagonal blocks of A_ab, compact, masked
            Akh = T.alloc_shared((C, C), _SPLIT)
            Akl = T.alloc_shared((C, C), _SPLIT)
            # ---- WY ----
            Dd_s = T.alloc_shared((C, S), f32)
            Dh = T.alloc_shared((C, C), _SPLIT)
            Dl = T.alloc_shared((C, C), _SPLIT)
            Lh = T.alloc_shared((C, C), _SPLIT)
            Ll = T.alloc_shared((C, C), _SPLIT)
            Mh = T.alloc_shared((C, C), _SPLIT)
            Ml = T.alloc_shared((C, C), _SPLIT)
            M2h = T.alloc_shared((C, C), _SPLIT)
            M2l = T.alloc_shared((C, C), _SPLIT)
            Ph = T.alloc_shared((C, C), _SPLIT)
            Pl = T.alloc_shared((C, C), _SPLIT)
            Ih = T.alloc_shared((C, C), _SPLIT)
            Il = T.alloc_shared((C, C), _SPLIT)
            Qh = T.alloc_shared((C, C), ddt)
            Ql = T.alloc_shared((C, C), ddt)
            Iwh = Iwl = None
            if not share_inv:
                Iwh = T.alloc_shared((C, C), ddt)
                Iwl = T.alloc_shared((C, C), ddt)
            P_f = T.alloc_fragment((C, C), f32)
            M_f = T.alloc_fragment((C, C), f32)
            M2_f = T.alloc_fragment((C, C), f32)
            W_f = T.alloc_fragment((C, K), f32)
            U_f = T.alloc_fragment((C, BV), f32)
            w_s = T.alloc_shared((C, K), dtype)
            u_s = T.alloc_shared((C, BV), dtype)
            # ---- state ----
            hh_s = T.alloc_shared((K, BV), dtype)
            hl_s = T.alloc_shared((K, BV), dtype)
            vh_s = T.alloc_shared((C, BV), dtype)
            vl_s = T.alloc_shared((C, BV), dtype)
            vn_f = T.alloc_fragment((C, BV), f32)
            o_f = T.alloc_fragment((C, BV), f32)

            if N0 > 0:  # an initial state was passed
                T.copy(h0[i_n, i_h, :, v0 : v0 + BV], h_f)
            else:
                T.clear(h_f)

            for c in T.serial(n_chunks):
                t0 = bos + c * C
                L = T.min(eos - t0, C)
                T.sync_threads()  # every thread is done with the previous chunk's tiles
                load_chunk(q, k, a, b, gk, t0, i_h, q_t, k_t, a_t, b_t, G)

                # ================= intra =================
                if do_intra:
                    gate_scan(L, T.get_thread_binding(), G, Tot, run, vals)
                    for kk in T.Parallel(K):
                        gl_s[kk] = G[C, kk]
                        if G[C, kk] < -centred_max_decay():  # past the centred range
                            flags[i_n, i_h] = 1
                    if share_operands:
                        four_products(G, q_t, a_t, b_t, k_t, Xc, Wc, Yc, Zc, F1, F2, F3, F4)
                        store_qk_qb(F1, F2, Aqk_s, Aqb_s, scale)
                        stage_ab_ak(F3, F4, L, Nd_s, Lh, Ll, Akh, Akl)
                    else:
                        # A_qk, A_qb first: their outputs (16 KB) are smaller than what A_ab /
                        # A_ak leave for the WY stage (36 KB), so this order keeps the peak lower
                        # F1 = Qc Bc^T = A_qb, F2 = Qc Kc^T = A_qk (operands in X, Y, Z order)
                        intra_products(G, q_t, b_t, k_t, Xc, Yc, Zc, F1, F2, operands_qk_qb)
                        store_qk_qb(F1, F2, Aqk_s, Aqb_s, scale)
                        intra_products(G, a_t, b_t, k_t, Xc, Yc, Zc, F1, F2, operands_ab_ak)
                        stage_ab_ak(F1, F2, L, Nd_s, Lh, Ll, Akh, Akl)
                    gated_tiles(L, G, q_t, k_t, a_t, b_t, Rq, Rk, Ra, Rb, scale)
                # v only now (needed from u = Q v on): it lands under the inverse chain and
                # is not live during the intra products, the shared-memory peak
                T.async_copy(v[0, t0 : t0 + C, i_h, v0 : v0 + BV], v_t)

                # ================= WY: Inv = (I + M^2)(I + M) D, M = D L =================
                if do_wy:
                    block_diagonal_inverses(Nd_s, x, Dd_s)
                    T.sync_threads()
                    for i, j in T.Parallel(C, C):
                        P_f[i, j] = d_entry(Dd_s)(i, j)
                    split_of(d_entry(Dd_s), Dh, Dl)
                    T.clear(M_f)
                    gemm3_over(Dh, Dl, Lh, Ll, M_f, KR["M"])  # M = D L
                    join(M_f)
                    split(M_f, Mh, Ml)
                    gemm3_over(Mh, Ml, Dh, Dl, P_f, KR["P"])  # P = D + M D
                    T.clear(M2_f)
                    gemm3_over(Mh, Ml, Mh, Ml, M2_f, KR["M2"])  # M^2, in flight with P
                    join(P_f, M2_f)
                    split(M2_f, M2h, M2l)
                    split(P_f, Ph, Pl)
                    gemm3_over(M2h, M2l, Ph, Pl, P_f, KR["Inv"])  # Inv = P + M^2 P
                    join(P_f)
                    split(P_f, Ih, Il)
                    if not share_inv:
                        split(P_f, Iwh, Iwl)
                    # Q = Inv A_ak, w = Inv ag (ag rows >= L are zero)
                    T.clear(M_f)
                    gemm3(Ih, Il, Akh, Akl, M_f)
                    T.clear(W_f)
                    if share_inv:
                        gemm2(Ih, Il, a_t, W_f)
                    else:
                        gemm2(Iwh, Iwl, a_t, W_f)
                    join(M_f, W_f)
                    split(M_f, Qh, Ql)
                    # v rows >= L read as zero (u = Q v, kg^T v)
                    T.ptx_wait_group(0)
                    T.sync_threads()
                    for i, j in T.Parallel(C, BV):
                        if i >= L:
                            v_t[i, j] = T.Cast(dtype, 0)
                    T.copy(W_f, w_s)  # w rounded to the data dtype, as the staged path stores it
                    T.clear(U_f)
                    gemm2(Qh, Ql, v_t, U_f)  # u = Q v
                    join(U_f)
                    T.copy(U_f, u_s)  # u rounded to the data dtype, as staged

                # ================= state =================
                if do_state:
                    if not do_wy:  # v's copy is joined in the WY phase
                        T.ptx_wait_group(0)
                    for kk, j in T.Parallel(K, BV):
                        hh_s[kk, j] = T.Cast(dtype, h_f[kk, j])
                        hl_s[kk, j] = T.Cast(dtype, h_f[kk, j] - T.Cast(f32, T.Cast(dtype, h_f[kk, j])))
                    for kk, j in T.Parallel(K, BV):
                        h_f[kk, j] = h_f[kk, j] * T.exp2(gl_s[kk])
                    T.sync_threads()
                    # phase 1: v_new = w h, o = qg h + A_qk v, h += kg^T v
                    T.gemm(w_s, hh_s, vn_f, clear_accum=True, annotations=_NOWAIT)
                    T.gemm(w_s, hl_s, vn_f, annotations=_NOWAIT)
                    T.gemm(q_t, hh_s, o_f, clear_accum=True, annotations=_NOWAIT)
                    T.gemm(q_t, hl_s, o_f, annotations=_NOWAIT)
                    T.gemm(Aqk_s, v_t, o_f, annotations=_NOWAIT)
                    T.gemm(k_t, v_t, h_f, transpose_A=True, annotations=_NOWAIT)
                    T.wait_wgmma(0)
                    for i, j in T.Parallel(C, BV):
                        vn_f[i, j] = T.if_then_else(i < L, vn_f[i, j] + T.Cast(f32, u_s[i, j]),
                                                    T.float32(0))
                    for i, j in T.Parallel(C, BV):
                        vh_s[i, j] = T.Cast(dtype, vn_f[i, j])
                        vl_s[i, j] = T.Cast(dtype, vn_f[i, j] - T.Cast(f32, T.Cast(dtype, vn_f[i, j])))
                    T.sync_threads()
                    # phase 2: o += A_qb v_new, h += bg^T v_new
                    T.gemm(Aqb_s, vl_s, o_f, annotations=_NOWAIT)
                    T.gemm(Aqb_s, vh_s, o_f, annotations=_NOWAIT)
                    T.gemm(b_t, vl_s, h_f, transpose_A=True, annotations=_NOWAIT)
                    T.gemm(b_t, vh_s, h_f, transpose_A=True, annotations=_NOWAIT)
                    T.wait_wgmma(0)
                for i, j in T.Parallel(C, BV):
                    if i < L:
                        o[0, t0 + i, i_h, v0 + j] = T.Cast(dtype, o_f[i, j])

            T.copy(h_f, ht[i_n, i_h, :, v0 : v0 + BV])

    return fused_fwd


def variants():
    """Every config the dispatch builds: C = 64, K = V = 64, bf16 / fp16, fp32 or dtype gates."""
    for C, K, dt in itertools.product(CHUNK_SIZES, HEAD_DIMS, DTYPES):
        for gate_dtype in (_ACC, dt):
            yield dict(C=C, K=K, V=K, dtype=dt, gate_dtype=gate_dtype)


def ref_program(q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size,
                use_initial_state, lower_bound=float("-inf")):
    """The contract: the staged PyTorch forward (intra -> WY -> state, no kept activations);
    returns (o, final_state)."""
    from torch_dplr.ops.intra import chunk_intra_fwd_reference
    from torch_dplr.ops.state import chunk_state_fwd_reference
    from torch_dplr.ops.wy import chunk_wy_fwd_reference

    gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = chunk_intra_fwd_reference(
        q, k, a, b, gk, cu_seqlens, scale, chunk_size, lower_bound)
    _, w, u = chunk_wy_fwd_reference(A_ab, A_ak, ag, v, cu_seqlens, chunk_size)
    o, ht, _, _ = chunk_state_fwd_reference(qg, kg, bg, w, u, v, A_qk, A_qb, gl, initial_state,
                                            cu_seqlens, chunk_size, use_initial_state, False)
    return o, ht
