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
the dA matrices are dropped by a select, so whatever they hold is ignored.

Grid
----
One CTA per (K-block, head, chunk slot), 128 threads, grid ``(K/block_K * H * slots, B)``
with the (K-block, head) index fastest: the CTAs of one chunk run side by side and read
contiguous memory, and slots sit on grid x (no 65535 limit). Columns are independent, so K
is cut into ``block_K`` wide blocks (default 64). One variant for rect and varlen: the
kernel always sees a list of sequences (B == 1 at call time; a rect batch comes flattened,
``torch_dplr.ops.varlen.as_one_sequence_list``) and one CTA per chunk slot of
``torch_dplr.ops.varlen.kernel_tables`` (``chunk_start`` / ``chunk_len``; an empty slot
stores nothing).

Loading and passes
------------------
Every global load of a CTA is issued at its start, before anything waits: the nine
[C, BK] tiles (q, k, a, b, gk, dqg, dkg, dag, dbg) as cp.async 16-byte copies into shared
memory (rows past T zero-filled), the four C x C dA tiles as 16-byte register loads with
their rows clamped into the tensor (no branch), dgl and one dag row as scalars; then one
wait. Rows past ``chunk_len`` (another sequence's tokens) are masked (a select) where a
tile is read, never at load time, and the dA tiles are masked to their triangles and rows
when stored as GEMM operands. (The earlier version read its inputs inside the element-wise
passes: scalar loads behind branches, each waiting a full memory latency, and one CTA per
SM: 8.8 ms at the design shape, 8% of HBM bandwidth.)

Then: gi by a per-column serial cumsum (one thread per column; rows in batches of 16 held
in registers so the loads overlap); the column sums of the t terms (the dgk constant, two
threads per column); the scheme's stages (below); dgk by a serial reverse scan per column
of the per-row terms G (in place in shared memory) and one coalesced store pass. In the
bounded stages no loop both reads and writes shared memory (values are staged in
registers), so TileLang puts one barrier before a loop rather than one per unrolled
iteration (its sync planner cannot prove swizzled accesses of two buffers disjoint).

Bounded stages: the raw q, k, b, a tiles become the GEMM operands Y1, X1, X2, Y2 in place
(the element-wise dgk terms, which need the raw values, are taken first). The a side (a,
dag and the rows of dA_ak, dA_ab) is held one row up: shared row r is chunk row r + 1, so
the fragment row r of the a-side GEMM is da's matrix part of row r + 1 and ``a da`` of row
r + 1 lands in row r, which turns the exclusive sum into an inclusive one without moving
data between threads; G stays in registers (the accumulator layout) until the final scan.
da of the chunk's first row is dag (no matrix part, ge = 0). Unbounded stages: see below;
G lives in shared memory there (``a da`` of row i is added to row i - 1).

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

Resources at 128 threads (shared buffers overlap by liveness; ``_CTAS_PER_SM`` caps the
registers through ``__launch_bounds__``, so they never bind below shared memory), any K:

    scheme     C   block_K  shared       registers  CTAs / SM
    bounded    64  64       112.5 KB     254-255    2 (both; 113 KB is the 2-CTA limit)
    bounded    32  32        28.5 KB     148-160    3 (registers; block_K 64 spills)
    bounded    16  64       22.5-24 KB   128        4 (registers)
    unbounded  64  64       187 KB       190-203    1 (shared)
    unbounded  32  64        90 KB       99-118     2 (shared)
    unbounded  16  64       39-40.5 KB   67-72      5 (shared)

No spills. Before this layout (loads inside the element-wise passes) the bounded C = 64
kernel held 129 KB and 131 registers: one CTA per SM. The bounded C = 64 budget is tight:
one more shared buffer can push it past 113 KB (one CTA per SM), and its registers sit at
ptxas' cap of 255 (``fence_fragments`` keeps nvcc from carrying element-wise values across
the GEMMs, which costs registers).

Shapes: q, k, a, b, dqg, dkg, dag, dbg, dq, dk, da, db [B, T, H, K] dtype;
gk, dgk [B, T, H, K] gk_dtype; gl, dgl [B, S, H, K] fp32 (S chunk slots; gl, the forward's
chunk totals, is read by the redo variant only);
dA_qk, dA_qb [B, T, H, C] dtype; dA_ak, dA_ab [B, T, H, C] fp32; scale is a
runtime fp32 scalar; chunk_start, chunk_len int32 [S]. B, T, H, S are symbolic (B == 1
at call time). Signature (call ``kernel(*inputs, *outputs)``, nothing returned)::

    intra_bwd(q, k, a, b, gk, gl, dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg,
              chunk_start, chunk_len, scale, dq, dk, da, db, dgk)
"""

# no "from __future__ import annotations": the prim_func annotations must evaluate eagerly
# (they name factory arguments that the function body does not reference)

import itertools
import math

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .compile import canonical_dtype, kernel_options
from .tile_macros import REDO_SPAN, broken_chunks_from, end_cta

__all__ = [
    "intra_bwd_kernel",
    "select_scheme",
    "bounded_max_decay",
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
_NOWAIT = {"wg_wait": -1}  # issue a GEMM without waiting for it (T.wait_wgmma joins)
#: CTAs per SM per (C, bounded) at 128 threads and the default block_K (module doc table):
#: what shared memory allows, or for C <= 32 bounded what fits without spills. Handed to
#: ptxas as the register cap (__launch_bounds__).
_CTAS_PER_SM = {(64, True): 2, (32, True): 3, (16, True): 4,
                (64, False): 1, (32, False): 2, (16, False): 4}


def _default_block_k(C: int, K: int, bounded: bool) -> int:
    """64, except 32 for the bounded scheme at C = 32: with 64 its mma path needs more than
    255 registers (ptxas loads all four GEMMs' operand fragments up front) and spills."""
    return min(K, 32 if (C, bounded) == (32, True) else 64)


#: Largest |exponent| of a centred GEMM operand each operand dtype tolerates.
#: bf16 has fp32's range: 2^100 leaves 2^27 for data magnitudes and C-term sums.
#: fp16 tops out at 65504 = 2^16: 2^8 leaves 2^8 for the data.
_CENTRED_EXPONENT_LIMIT = {"bfloat16": 100.0, "float16": 8.0}


def max_centred_exponent(C: int, lower_bound: float) -> float:
    """Largest |exponent| of the bounded scheme's operands: ``C |lower_bound| log2(e) / 2``."""
    return C * abs(lower_bound) * _LOG2E / 2


def bounded_max_decay(dtype) -> float:
    """Largest total decay of a chunk, ``-gl`` in log2 units, that the bounded scheme computes
    in range for this operand dtype (its exponents are ``|gl| / 2``).  A chunk past it breaks
    the declared bound; ``torch_dplr/ops/gate_bound.py`` recomputes it with the exact
    sub-block scheme."""
    return 2 * _CENTRED_EXPONENT_LIMIT[canonical_dtype(dtype)]


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
    redo: bool = False,
):
    """prim_func ``intra_bwd`` for one config (see the module docstring for the call).

    C: chunk size (16, 32, 64); K: head dim (multiple of block_K); dtype: bf16 / fp16
    (q, k, a, b, their gradients, dA_qk, dA_qb, GEMM operands); gk_dtype: dtype of gk
    and dgk (fp32 or dtype); bounded: exponent scheme (see :func:`select_scheme`).
    Schedule knobs (same results): block_K (0: 64; 32 for the bounded scheme at C = 32)
    and threads (0: 128).

    redo (unbounded only): the exact recompute after the bounded kernel (``torch_dplr/ops/
    gate_bound.py``): each CTA covers ``REDO_SPAN`` chunks of a (K-block, head), tests their
    forward chunk totals ``gl`` at once and computes only the chunks where some column decays
    past :func:`bounded_max_decay` (they broke the declared bound), one after another; every
    other chunk, and every empty slot, is left unwritten.  Without redo, ``gl`` is not read.
    """
    dtype = canonical_dtype(dtype)
    gk_dtype = canonical_dtype(gk_dtype)
    if C not in CHUNK_SIZES:
        raise ValueError(f"chunk size C={C} not in {CHUNK_SIZES}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if gk_dtype not in ("float32", dtype):
        raise ValueError(f"gk_dtype={gk_dtype}: must be float32 or dtype={dtype}")
    if redo and bounded:
        raise ValueError("redo: only the unbounded scheme recomputes chunks that broke the bound")
    BK = block_K or _default_block_k(C, K, bounded)
    threads = threads or 128
    if BK % 16 or K % BK or BK > 128:
        raise ValueError(f"block_K={BK}: need a multiple of 16, <= 128, dividing K={K}")
    if threads % 32 or threads % BK or (_SUB * BK) % threads or threads < BK:
        raise ValueError(f"threads={threads} must be a multiple of block_K={BK} dividing 16*block_K")
    NK = K // BK
    broken_chunks = broken_chunks_from(K, threads, REDO_SPAN)  # the redo form's test
    nb = C // _SUB
    NG = threads // BK  # threads per column in the per-column passes
    stages = tuple(range(nb + 1))  # sub-block stages of the unbounded scheme
    SEG = C // NG  # rows per thread in the t-term column sums
    op = dtype  # GEMM operand dtype
    # bounded: the a side (a, dag, dA_ak, dA_ab rows) is held one row up, see the module doc
    sh = 1 if bounded else 0
    GPAD = 8  # fp32 pad per row of G_s: conflict-free fragment-layout writes

    B, Tn, H, S = T.dynamic("B, T, H, S")

    # ------------------------------------------------------------------ helpers
    def masked(x, ok):
        """fp32 value of a raw tile element; rows outside the chunk (ok false) read as 0."""
        return T.if_then_else(ok, T.Cast(_ACC, x), T.float32(0))

    def last_gi(gi_s, L, c):
        """gl: gi at the chunk's last row. Rows past L add 0, so that is row L - 1 (a runtime
        index): TileLang 0.1.15 folds a swizzled read at the constant row C - 1 into a wrong
        address when block_K = 32 (found on the bounded C = 32 kernel)."""
        return gi_s[T.max(L - 1, 0), c]

    def clamp_row(t):
        """A row index inside [0, T): rows loaded from there are masked, never used."""
        return T.max(T.min(t, Tn - 1), 0)

    def swizzle(*bufs):
        """Swizzled layouts: fragment-layout reads and per-column reads both conflict-free."""
        return {buf: make_swizzled_layout(buf) for buf in bufs}

    @T.macro
    def issue_tile_loads(q, k, a, b, gk, dqg, dkg, dag, dbg, i_b, i_h, k0, t0,
                         gate_s, q_s, k_s, a_s, b_s, dqg_s, dkg_s, dag_s, dbg_s):
        """cp.async of every [C, BK] input tile (one commit group each, nothing waits here).
        Rows past T are zero-filled; rows past the chunk are masked where they are read."""
        T.async_copy(gk[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], gate_s)
        T.async_copy(q[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], q_s)
        T.async_copy(k[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], k_s)
        T.async_copy(b[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], b_s)
        T.async_copy(a[i_b, t0 + sh : t0 + sh + C, i_h, k0 : k0 + BK], a_s)
        T.async_copy(dqg[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], dqg_s)
        T.async_copy(dkg[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], dkg_s)
        T.async_copy(dbg[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], dbg_s)
        T.async_copy(dag[i_b, t0 + sh : t0 + sh + C, i_h, k0 : k0 + BK], dag_s)

    @T.macro
    def load_dA(dA_qk, dA_qb, dA_ak, dA_ab, i_b, i_h, t0, rqk, rqb, rak, rab):
        """The four C x C dA tiles into registers: vector loads with no branch (rows clamped
        into the tensor), all in flight together with the async copies."""
        for r, j in T.Parallel(C, C):
            rqk[r, j] = dA_qk[i_b, clamp_row(t0 + r), i_h, j]
        for r, j in T.Parallel(C, C):
            rqb[r, j] = dA_qb[i_b, clamp_row(t0 + r), i_h, j]
        for r, j in T.Parallel(C, C):
            rak[r, j] = dA_ak[i_b, clamp_row(t0 + r + sh), i_h, j]
        for r, j in T.Parallel(C, C):
            rab[r, j] = dA_ab[i_b, clamp_row(t0 + r + sh), i_h, j]

    @T.macro
    def store_dA(L, rqk, rqb, rak, rab, Aqk, Aqb, Aak, Aab):
        """dA tiles -> GEMM operands: masked to their triangle and to the chunk's rows (a
        select, so whatever the masked part holds is dropped), cast to the operand dtype."""
        for r, j in T.Parallel(C, C):
            Aqk[r, j] = T.if_then_else((j <= r) & (r < L), rqk[r, j], T.Cast(op, 0))
        for r, j in T.Parallel(C, C):
            Aqb[r, j] = T.if_then_else((j <= r) & (r < L), rqb[r, j], T.Cast(op, 0))
        for r, j in T.Parallel(C, C):  # row r holds dA_ak row r + sh (strictly lower part)
            Aak[r, j] = T.Cast(op, T.if_then_else((j < r + sh) & (r + sh < L), rak[r, j], T.float32(0)))
        for r, j in T.Parallel(C, C):
            Aab[r, j] = T.Cast(op, T.if_then_else((j < r + sh) & (r + sh < L), rab[r, j], T.float32(0)))

    @T.macro
    def gate_cumsum(L, tx, gate_s, gi_s, acc, vals):
        """gi: inclusive cumsum of log2e * gk down each column (one thread per column, serial
        in row order). Rows go in batches of _SUB loaded into registers before any store, so
        the loads of a batch are in flight together."""
        if tx < BK:
            acc[0] = T.float32(0)
            for r0 in T.unroll(0, C, _SUB):
                for m in T.unroll(_SUB):
                    vals[m] = masked(gate_s[r0 + m, tx], r0 + m < L) * _LOG2E
                for m in T.unroll(_SUB):
                    acc[0] = acc[0] + vals[m]
                    gi_s[r0 + m, tx] = acc[0]

    @T.macro
    def t_column_sums(L, tx, gi_s, k_s, b_s, dkg_s, dbg_s, dgl_v, tpart, tsum_s):
        """This thread's share of the dgk constant of its column c = tx % BK: the t terms
        sum_r 2^(gl - gi_r) (k dkg + b dbg)_r of rows [s SEG, (s+1) SEG), s = tx // BK, and
        for s = 0 also log2e dgl."""
        c = tx % BK
        tpart[0] = T.float32(0)
        for m in T.unroll(SEG):
            r = (tx // BK) * SEG + m
            ok = r < L
            te = T.exp2(last_gi(gi_s, L, c) - gi_s[r, c])
            tpart[0] = tpart[0] + te * (masked(k_s[r, c], ok) * masked(dkg_s[r, c], ok)
                                        + masked(b_s[r, c], ok) * masked(dbg_s[r, c], ok))
        if tx < BK:
            tpart[0] = tpart[0] + dgl_v[0] * _LOG2E
        tsum_s[tx // BK, c] = tpart[0]

    @T.macro
    def dgk_pass(i_b, i_h, k0, t0, L, tx, G_s, tsum_s, acc, dgk):
        """dgk_i = sum_{r >= i} G_r + the column constant (its parts in tsum_s): a serial
        reverse scan per column (one thread each, in place), then one coalesced store pass."""
        if tx < BK:
            acc[0] = T.float32(0)
            for s in T.unroll(NG):
                acc[0] = acc[0] + tsum_s[s, tx]
            acc[1] = T.float32(0)
            for m in T.unroll(C):
                r = C - 1 - m
                acc[1] = acc[1] + G_s[r, tx]
                G_s[r, tx] = acc[1] + acc[0]
        T.sync_threads()
        for r, c in T.Parallel(C, BK):
            if r < L:
                dgk[i_b, t0 + r, i_h, k0 + c] = T.Cast(gk_dtype, G_s[r, c])

    # ------------------------------------------------------- bounded (centred) scheme
    def fence_fragments(*frags):
        """A compiler barrier on these [C, BK] fp32 fragments (an empty asm per register, with
        a memory clobber): nvcc may not move their computation, nor memory accesses, across
        it. Without it nvcc carried element-wise values across the GEMMs (more registers)."""
        for frag in frags:
            T.warpgroup_fence_operand(frag, num_regs=C * BK // threads)

    @T.macro
    def centred_stages(i_b, i_h, k0, t0, L, scale, gi_s, q_s, k_s, a_s, b_s,
                       dqg_s, dkg_s, dag_s, dbg_s, Aqk, Aqb, Aak, Aab, X1, X2, Y1, Y2,
                       F1, F2, G_f, dq, dk, da, db):
        """Centre c = gl / 2 per column; q_s, k_s, b_s, a_s become Y1, X1, X2, Y2 in place
        (X1..Y2 here: register staging). G_f (registers, the fragment layout of F1 / F2)
        collects every per-row dgk term."""
        # ---- elementwise dgk terms and the centred operands from the raw tiles (registers),
        # then the operands over the raw tiles (a loop that only writes shared memory gets
        # one barrier before it, not one per iteration)
        for r, c in T.Parallel(C, BK):
            ok = r < L
            oka = r + 1 < L  # a side: this row holds chunk row r + 1
            g = gi_s[r, c]
            gl = last_gi(gi_s, L, c)
            qv = masked(q_s[r, c], ok)
            kv = masked(k_s[r, c], ok)
            bv = masked(b_s[r, c], ok)
            av = masked(a_s[r, c], oka)
            gq = masked(dqg_s[r, c], ok) * T.exp2(g)
            ga = masked(dag_s[r, c], oka) * T.exp2(g)  # ge of row r + 1 is gi of row r
            t_end = T.exp2(gl - g) * (kv * masked(dkg_s[r, c], ok) + bv * masked(dbg_s[r, c], ok))
            G_f[r, c] = scale * qv * gq + av * ga - t_end
            fx = T.exp2(gl * 0.5 - g)
            fy = T.exp2(g - gl * 0.5)
            X1[r, c] = T.Cast(op, kv * fx)
            X2[r, c] = T.Cast(op, bv * fx)
            Y1[r, c] = T.Cast(op, scale * qv * fy)
            Y2[r, c] = T.Cast(op, av * fy)  # of row r + 1
        fence_fragments(G_f)  # G_f is final here: its inputs must not live on past the GEMMs
        for r, c in T.Parallel(C, BK):
            k_s[r, c] = X1[r, c]
            b_s[r, c] = X2[r, c]
            q_s[r, c] = Y1[r, c]
            a_s[r, c] = Y2[r, c]
        # ---- rows: dq, da (F2 row r is da's matrix part of row r + 1)
        T.gemm(Aqk, k_s, F1, clear_accum=True, annotations=_NOWAIT)
        T.gemm(Aqb, b_s, F1, annotations=_NOWAIT)
        T.gemm(Aak, k_s, F2, clear_accum=True, annotations=_NOWAIT)
        T.gemm(Aab, b_s, F2, annotations=_NOWAIT)
        T.wait_wgmma(0)
        fence_fragments(F1, F2)
        for r, c in T.Parallel(C, BK):
            g = gi_s[r, c]
            f = T.exp2(g - last_gi(gi_s, L, c) * 0.5)
            gq = masked(dqg_s[r, c], r < L) * T.exp2(g)
            ga = masked(dag_s[r, c], r + 1 < L) * T.exp2(g)
            if r < L:
                dq[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, scale * (F1[r, c] * f + gq))
            if r + 1 < L:
                da[i_b, t0 + r + 1, i_h, k0 + c] = T.Cast(dtype, F2[r, c] * f + ga)
            # rounded operand x GEMM result: cancels the column side's term exactly
            G_f[r, c] = G_f[r, c] + T.Cast(_ACC, q_s[r, c]) * F1[r, c] + T.Cast(_ACC, a_s[r, c]) * F2[r, c]
        # ---- columns: dk, db
        T.gemm(Aqk, q_s, F1, transpose_A=True, clear_accum=True, annotations=_NOWAIT)
        T.gemm(Aak, a_s, F1, transpose_A=True, annotations=_NOWAIT)
        T.gemm(Aqb, q_s, F2, transpose_A=True, clear_accum=True, annotations=_NOWAIT)
        T.gemm(Aab, a_s, F2, transpose_A=True, annotations=_NOWAIT)
        T.wait_wgmma(0)
        fence_fragments(F1, F2)
        for r, c in T.Parallel(C, BK):
            ok = r < L
            g = gi_s[r, c]
            gl = last_gi(gi_s, L, c)
            f = T.exp2(gl * 0.5 - g)
            te = T.exp2(gl - g)
            if ok:
                dk[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, F1[r, c] * f + masked(dkg_s[r, c], ok) * te)
                db[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, F2[r, c] * f + masked(dbg_s[r, c], ok) * te)
            G_f[r, c] = G_f[r, c] - T.Cast(_ACC, k_s[r, c]) * F1[r, c] - T.Cast(_ACC, b_s[r, c]) * F2[r, c]

    # ------------------------------------------------- unbounded (sub-block) scheme
    def mat_term(F, S_, i, c, factor, use_gemm):
        """Matrix part of one output element: F * factor (GEMM) + S (diagonal block)."""
        v = S_[i, c]
        if use_gemm:
            v = F[i, c] * factor + v
        return v

    def pair_term(F, Op, S_, x, i, r, c, use_gemm):
        """The same matrix part times its row's own operand, for the dgk sums: the GEMM
        part multiplies the *rounded* operand the other side's GEMM used, so each (i, j)
        pair's row and column contributions cancel exactly where the reference's do."""
        v = x * S_[i, c]
        if use_gemm:
            v = T.Cast(_ACC, Op[r, c]) * F[i, c] + v
        return v

    def prev_gi(gi_s, r, c):
        """ge at row r: gi of row r-1, 0 at the chunk's first row."""
        return T.if_then_else(r > 0, gi_s[T.max(r - 1, 0), c], T.float32(0))

    @T.macro
    def row_epilogue(r0, F1, F2, piv, S1, S2, use_gemm, Y1, Y2, i_b, i_h, k0, t0, L, scale,
                     gi_s, q_s, a_s, dqg_s, dag_s, G_s, dq, da):
        """dq, da of sub-block rows r0..r0+15: matrix part, elementwise terms, store, dgk
        terms (a_i da_i goes to row i-1: the exclusive sum)."""
        for i, c in T.Parallel(_SUB, BK):
            r = r0 + i
            ok = r < L
            g = gi_s[r, c]
            e = prev_gi(gi_s, r, c)
            qv = masked(q_s[r, c], ok)
            av = masked(a_s[r, c], ok)
            gq = masked(dqg_s[r, c], ok) * T.exp2(g)
            ga = masked(dag_s[r, c], ok) * T.exp2(e)
            vq = scale * (mat_term(F1, S1, i, c, T.exp2(g - piv[c]), use_gemm) + gq)
            va = mat_term(F2, S2, i, c, T.exp2(e - piv[c]), use_gemm) + ga
            if ok:
                dq[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, vq)
                da[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, va)
            G_s[r, c] = G_s[r, c] + pair_term(F1, Y1, S1, scale * qv, i, r, c, use_gemm)
            F2[i, c] = pair_term(F2, Y2, S2, av, i, r, c, use_gemm) + av * ga
        for i, c in T.Parallel(_SUB, BK):  # separate loop: row r-1 has another owner
            r = r0 + i
            if r > 0:
                G_s[T.max(r - 1, 0), c] = G_s[T.max(r - 1, 0), c] + F2[i, c]

    @T.macro
    def col_epilogue(r0, F1, F2, piv, S1, S2, use_gemm, X1, X2, i_b, i_h, k0, t0, L,
                     gi_s, k_s, b_s, dkg_s, dbg_s, G_s, dk, db):
        """dk, db of sub-block rows r0..r0+15: matrix part, elementwise terms, store, dgk terms."""
        for i, c in T.Parallel(_SUB, BK):
            r = r0 + i
            ok = r < L
            g = gi_s[r, c]
            f = T.exp2(piv[c] - g)
            te = T.exp2(last_gi(gi_s, L, c) - g)
            kv = masked(k_s[r, c], ok)
            bv = masked(b_s[r, c], ok)
            vk = mat_term(F1, S1, i, c, f, use_gemm) + masked(dkg_s[r, c], ok) * te
            vb = mat_term(F2, S2, i, c, f, use_gemm) + masked(dbg_s[r, c], ok) * te
            if ok:
                dk[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, vk)
                db[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, vb)
            G_s[r, c] = (G_s[r, c] - pair_term(F1, X1, S1, kv, i, r, c, use_gemm)
                         - pair_term(F2, X2, S2, bv, i, r, c, use_gemm))

    @T.macro
    def subblock_stages(i_b, i_h, k0, t0, L, scale, tx, gi_s, d_s, q_s, k_s, a_s, b_s,
                        dqg_s, dkg_s, dag_s, dbg_s, Aqk, Aqb, Aak, Aab, X1, X2, Y1, Y2,
                        piv, S1, S2, F1, F2, G_s, acc, dq, dk, da, db):
        """Stage I = 0..C/16: sub-block row I (dq, da) and sub-block column I-1 (dk, db)."""
        col = tx % BK
        lane_row = tx // BK
        # ---- per-row elementwise dgk terms (the a da terms come with the row epilogue)
        for r, c in T.Parallel(C, BK):
            ok = r < L
            g = gi_s[r, c]
            qv = masked(q_s[r, c], ok)
            gq = masked(dqg_s[r, c], ok) * T.exp2(g)
            t_end = T.exp2(last_gi(gi_s, L, c) - g) * (masked(k_s[r, c], ok) * masked(dkg_s[r, c], ok)
                                                  + masked(b_s[r, c], ok) * masked(dbg_s[r, c], ok))
            G_s[r, c] = scale * qv * gq - t_end
        for I in stages:  # a tuple: unrolled at trace time
            lo = _SUB * I  # first row of sub-block I; pivot P = gi[lo - 1]
            if 1 <= I < nb:  # pivot and operands of the GEMMs straddling row lo
                for c in T.Parallel(BK):
                    piv[c] = gi_s[lo - 1, c]
                for r, c in T.Parallel(lo, BK):  # rows before the pivot
                    fx = T.exp2(piv[c] - gi_s[r, c])
                    X1[r, c] = T.Cast(op, masked(k_s[r, c], r < L) * fx)
                    X2[r, c] = T.Cast(op, masked(b_s[r, c], r < L) * fx)
                for r_, c in T.Parallel(C - lo, BK):  # rows after the pivot
                    r = lo + r_
                    Y1[r, c] = T.Cast(op, scale * masked(q_s[r, c], r < L) * T.exp2(gi_s[r, c] - piv[c]))
                    Y2[r, c] = T.Cast(op, masked(a_s[r, c], r < L) * T.exp2(gi_s[r - 1, c] - piv[c]))
            if I < nb:
                # ---- sub-block row I: dq, da
                if I >= 1:
                    T.gemm(Aqk[lo : lo + _SUB, 0:lo], X1[0:lo, :], F1, clear_accum=True,
                           policy=T.GemmWarpPolicy.FullCol, annotations=_NOWAIT)
                    T.gemm(Aqb[lo : lo + _SUB, 0:lo], X2[0:lo, :], F1,
                           policy=T.GemmWarpPolicy.FullCol, annotations=_NOWAIT)
                    T.gemm(Aak[lo : lo + _SUB, 0:lo], X1[0:lo, :], F2, clear_accum=True,
                           policy=T.GemmWarpPolicy.FullCol, annotations=_NOWAIT)
                    T.gemm(Aab[lo : lo + _SUB, 0:lo], X2[0:lo, :], F2,
                           policy=T.GemmWarpPolicy.FullCol, annotations=_NOWAIT)
                # diagonal block, Horner over j = lo..i:  acc = acc * d_j + w_ij
                for s in T.serial(_SUB // NG):
                    il = lane_row + s * NG
                    i = lo + il
                    acc[0] = T.float32(0)
                    acc[1] = T.float32(0)
                    for jl in T.serial(il):
                        j = lo + jl
                        dj = d_s[j, col]
                        kj = masked(k_s[j, col], j < L)
                        bj = masked(b_s[j, col], j < L)
                        acc[0] = acc[0] * dj + (T.Cast(_ACC, Aqk[i, j]) * kj + T.Cast(_ACC, Aqb[i, j]) * bj)
                        acc[1] = acc[1] * dj + (T.Cast(_ACC, Aak[i, j]) * kj + T.Cast(_ACC, Aab[i, j]) * bj)
                    acc[0] = acc[0] * d_s[i, col] + (T.Cast(_ACC, Aqk[i, i]) * masked(k_s[i, col], i < L)
                                                     + T.Cast(_ACC, Aqb[i, i]) * masked(b_s[i, col], i < L))
                    S1[il, col] = acc[0]
                    S2[il, col] = acc[1]
                if I >= 1:
                    T.wait_wgmma(0)
                row_epilogue(lo, F1, F2, piv, S1, S2, I >= 1, Y1, Y2, i_b, i_h, k0, t0, L, scale,
                             gi_s, q_s, a_s, dqg_s, dag_s, G_s, dq, da)
            if I >= 1:
                # ---- sub-block column I-1: dk, db
                jo = lo - _SUB
                if I < nb:
                    T.gemm(Aqk[lo:C, jo:lo], Y1[lo:C, :], F1, transpose_A=True, clear_accum=True,
                           policy=T.GemmWarpPolicy.FullCol, annotations=_NOWAIT)
                    T.gemm(Aak[lo:C, jo:lo], Y2[lo:C, :], F1, transpose_A=True,
                           policy=T.GemmWarpPolicy.FullCol, annotations=_NOWAIT)
                    T.gemm(Aqb[lo:C, jo:lo], Y1[lo:C, :], F2, transpose_A=True, clear_accum=True,
                           policy=T.GemmWarpPolicy.FullCol, annotations=_NOWAIT)
                    T.gemm(Aab[lo:C, jo:lo], Y2[lo:C, :], F2, transpose_A=True,
                           policy=T.GemmWarpPolicy.FullCol, annotations=_NOWAIT)
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
                        qi = masked(q_s[i, col], i < L)
                        ai = masked(a_s[i, col], i < L)
                        acc[0] = acc[0] * dn + T.Cast(_ACC, Aqk[i, j]) * qi
                        acc[1] = acc[1] * dn + T.Cast(_ACC, Aqb[i, j]) * qi
                        acc[2] = acc[2] * di + T.Cast(_ACC, Aak[i, j]) * ai
                        acc[3] = acc[3] * di + T.Cast(_ACC, Aab[i, j]) * ai
                    dn = T.if_then_else(jl < _SUB - 1, d_s[T.min(j + 1, C - 1), col], T.float32(0))
                    qj = masked(q_s[j, col], j < L)
                    acc[0] = acc[0] * dn + T.Cast(_ACC, Aqk[j, j]) * qj
                    acc[1] = acc[1] * dn + T.Cast(_ACC, Aqb[j, j]) * qj
                    S1[jl, col] = scale * acc[0] + acc[2]
                    S2[jl, col] = scale * acc[1] + acc[3]
                if I < nb:
                    T.wait_wgmma(0)
                col_epilogue(jo, F1, F2, piv, S1, S2, I < nb, X1, X2, i_b, i_h, k0, t0, L,
                             gi_s, k_s, b_s, dkg_s, dbg_s, G_s, dk, db)

    # ------------------------------------------------------------------ kernel
    @T.macro
    def body(q, k, a, b, gk, dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg, scale,
             dq, dk, da, db, dgk, i_kh, i_c, i_b, t0, L):
        i_k = i_kh % NK
        i_h = i_kh // NK
        k0 = i_k * BK

        # raw [C, BK] tiles (bounded: q, k, b, a are rewritten in place as the GEMM operands)
        q_s = T.alloc_shared((C, BK), dtype)
        k_s = T.alloc_shared((C, BK), dtype)
        a_s = T.alloc_shared((C, BK), dtype)
        b_s = T.alloc_shared((C, BK), dtype)
        dqg_s = T.alloc_shared((C, BK), dtype)
        dkg_s = T.alloc_shared((C, BK), dtype)
        dag_s = T.alloc_shared((C, BK), dtype)
        dbg_s = T.alloc_shared((C, BK), dtype)
        gi_s = T.alloc_shared((C, BK), _ACC)
        gate_s = T.alloc_shared((C, BK), gk_dtype)  # raw gates; dead before the dA tiles exist
        Aqk = T.alloc_shared((C, C), op)
        Aqb = T.alloc_shared((C, C), op)
        Aak = T.alloc_shared((C, C), op)
        Aab = T.alloc_shared((C, C), op)
        rqk = T.alloc_fragment((C, C), dtype)
        rqb = T.alloc_fragment((C, C), dtype)
        rak = T.alloc_fragment((C, C), _ACC)
        rab = T.alloc_fragment((C, C), _ACC)
        acc = T.alloc_local((4,), _ACC)
        vals = T.alloc_local((_SUB,), _ACC)
        tpart = T.alloc_local((1,), _ACC)
        dgl_v = T.alloc_local((1,), _ACC)
        da0 = T.alloc_local((1,), dtype)
        tx = T.get_thread_binding()
        layouts = swizzle(dqg_s, dkg_s, dag_s, dbg_s, gi_s)
        if bounded:
            F1 = T.alloc_fragment((C, BK), _ACC)
            F2 = T.alloc_fragment((C, BK), _ACC)
            G_f = T.alloc_fragment((C, BK), _ACC)
            X1 = T.alloc_fragment((C, BK), op)
            X2 = T.alloc_fragment((C, BK), op)
            Y1 = T.alloc_fragment((C, BK), op)
            Y2 = T.alloc_fragment((C, BK), op)
        else:
            layouts.update(swizzle(q_s, k_s, a_s, b_s))
            d_s = T.alloc_shared((C, BK), _ACC)
            X1 = T.alloc_shared((C, BK), op)  # k side operand
            X2 = T.alloc_shared((C, BK), op)  # b side operand
            Y1 = T.alloc_shared((C, BK), op)  # scale * q side operand
            Y2 = T.alloc_shared((C, BK), op)  # a side operand
            piv = T.alloc_shared((BK,), _ACC)
            S1 = T.alloc_shared((_SUB, BK), _ACC)
            S2 = T.alloc_shared((_SUB, BK), _ACC)
            F1 = T.alloc_fragment((_SUB, BK), _ACC)
            F2 = T.alloc_fragment((_SUB, BK), _ACC)
        G_s = T.alloc_shared((C, BK + GPAD), _ACC)  # per-row dgk terms, then dgk
        tsum_s = T.alloc_shared((NG, BK), _ACC)  # parts of the dgk constant per column
        T.annotate_layout(layouts)

        # ---- loads: everything in flight at once, one wait
        if tx < BK:
            dgl_v[0] = dgl[i_b, i_c, i_h, k0 + tx]
            if bounded:  # da of the chunk's first row is dag (no matrix part, ge = 0)
                da0[0] = dag[i_b, clamp_row(t0), i_h, k0 + tx]
        issue_tile_loads(q, k, a, b, gk, dqg, dkg, dag, dbg, i_b, i_h, k0, t0,
                         gate_s, q_s, k_s, a_s, b_s, dqg_s, dkg_s, dag_s, dbg_s)
        load_dA(dA_qk, dA_qb, dA_ak, dA_ab, i_b, i_h, t0, rqk, rqb, rak, rab)
        T.ptx_wait_group(0)
        if bounded:
            if tx < BK:
                if L > 0:
                    da[i_b, t0, i_h, k0 + tx] = da0[0]
        T.sync_threads()

        if not bounded:
            for r, c in T.Parallel(C, BK):  # per-row decay 2^(log2e gk) <= 1
                d_s[r, c] = T.exp2(masked(gate_s[r, c], r < L) * _LOG2E)
            T.sync_threads()
        gate_cumsum(L, tx, gate_s, gi_s, acc, vals)
        T.sync_threads()
        store_dA(L, rqk, rqb, rak, rab, Aqk, Aqb, Aak, Aab)
        t_column_sums(L, tx, gi_s, k_s, b_s, dkg_s, dbg_s, dgl_v, tpart, tsum_s)
        T.sync_threads()

        if bounded:
            centred_stages(i_b, i_h, k0, t0, L, scale, gi_s, q_s, k_s, a_s, b_s,
                           dqg_s, dkg_s, dag_s, dbg_s, Aqk, Aqb, Aak, Aab, X1, X2, Y1, Y2,
                           F1, F2, G_f, dq, dk, da, db)
            for r, c in T.Parallel(C, BK):
                G_s[r, c] = G_f[r, c]
        else:
            subblock_stages(i_b, i_h, k0, t0, L, scale, tx, gi_s, d_s, q_s, k_s, a_s, b_s,
                            dqg_s, dkg_s, dag_s, dbg_s, Aqk, Aqb, Aak, Aab, X1, X2, Y1, Y2,
                            piv, S1, S2, F1, F2, G_s, acc, dq, dk, da, db)
        T.sync_threads()
        dgk_pass(i_b, i_h, k0, t0, L, tx, G_s, tsum_s, acc, dgk)

    @T.prim_func
    def intra_bwd(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        a: T.Tensor((B, Tn, H, K), dtype),
        b: T.Tensor((B, Tn, H, K), dtype),
        gk: T.Tensor((B, Tn, H, K), gk_dtype),
        gl: T.Tensor((B, S, H, K), _ACC),
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
        if redo:
            # one CTA per REDO_SPAN chunks of a (K-block, head): it tests all their totals at
            # once and recomputes only the chunks that broke the bound, so a call where none
            # did costs a few waves of short CTAs instead of one CTA per chunk
            with T.Kernel(NK * H * T.ceildiv(S, REDO_SPAN), B, threads=threads) as (bx, i_b):
                T.annotate_min_blocks_per_sm(max(1, _CTAS_PER_SM[C, bounded] * 128 // threads))
                i_kh = bx % (NK * H)
                c0 = bx // (NK * H) * REDO_SPAN
                flags = T.alloc_shared((REDO_SPAN,), "int32")
                slots = T.alloc_shared((REDO_SPAN,), "int32")
                count = T.alloc_shared((1,), "int32")
                broken_chunks(gl, chunk_len, i_b, c0, S, i_kh // NK, -bounded_max_decay(dtype),
                              flags, slots, count)
                # the list in registers: a loop bound or index read from shared memory inside
                # the loop would need barriers TileLang cannot place
                n = T.alloc_local((1,), "int32")
                i_c = T.alloc_local((1,), "int32")
                n[0] = count[0]
                for i in T.serial(n[0]):
                    i_c[0] = slots[i]
                    body(q, k, a, b, gk, dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg,
                         scale, dq, dk, da, db, dgk, i_kh, i_c[0], i_b, chunk_start[i_c[0]],
                         chunk_len[i_c[0]])
                    T.sync_threads()  # the next chunk's loads reuse the shared tiles
        else:
            # (K-block, head) fastest, so the CTAs of one chunk run side by side and read
            # contiguous memory; slots on grid x (no 65535 limit)
            with T.Kernel(NK * H * S, B, threads=threads) as (bx, i_b):
                T.annotate_min_blocks_per_sm(max(1, _CTAS_PER_SM[C, bounded] * 128 // threads))
                i_kh = bx % (NK * H)
                i_c = bx // (NK * H)
                t0 = chunk_start[i_c]
                L = chunk_len[i_c]
                if not bounded:
                    if L == 0:  # an empty slot writes nothing
                        end_cta()
                body(q, k, a, b, gk, dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg, scale,
                     dq, dk, da, db, dgk, i_kh, i_c, i_b, t0, L)

    return intra_bwd


def variants():
    """Every config the dispatch can build (the compile test builds them all, the GPU test
    runs them): C x K x dtype x scheme x gate dtype (gk and dgk in fp32, or the input dtype),
    and the unbounded scheme's redo form of each."""
    for C, K, dt, bounded in itertools.product(CHUNK_SIZES, HEAD_DIMS, DTYPES, (True, False)):
        for gk_dtype in ("float32", dt):
            yield dict(C=C, K=K, dtype=dt, gk_dtype=gk_dtype, bounded=bounded)
            if not bounded:  # the exact recompute behind a bounded kernel
                yield dict(C=C, K=K, dtype=dt, gk_dtype=gk_dtype, bounded=False, redo=True)


def ref_program(q, k, a, b, gk, cu_seqlens, dgl, dA_qk, dA_qb, dA_ak, dA_ab, dqg, dkg, dag, dbg,
                scale, chunk_size):
    """The PyTorch kernel with this kernel's contract: (dq, dk, da, db, dgk)."""
    from torch_dplr.ops.intra import chunk_intra_bwd_reference

    return chunk_intra_bwd_reference(q, k, a, b, gk, cu_seqlens, dgl, dA_qk, dA_qb, dA_ak, dA_ab,
                                     dqg, dkg, dag, dbg, scale, chunk_size, float("-inf"))
