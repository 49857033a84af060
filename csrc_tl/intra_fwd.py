"""Intra-chunk stage forward (``dplr::chunk_intra_fwd``): gate cumsum, gated q/k/a/b and the
four C x C intra-chunk matrices, in one kernel.

Contract: :func:`torch_dplr.ops.intra.chunk_intra_fwd_reference` (math in
``torch_dplr/reference/intra.py``, DESIGN.md section 1). Per chunk of C rows, in log2 units:

    gi = log2e * cumsum(gk)     ge_i = gi_{i-1} (ge_0 = 0)     gl = gi[last row]
    A_qk[i,j] = scale sum_k q_ik k_jk 2^(gi_ik - gi_jk)   j <= i     (A_qb: b instead of k)
    A_ak[i,j] =       sum_k a_ik k_jk 2^(ge_ik - gi_jk)   j <  i     (A_ab: b instead of k)
    qg = scale q 2^gi   kg = k 2^(gl - gi)   ag = a 2^ge   bg = b 2^(gl - gi)

Entries above the mask are written as 0. Rows past a sequence's end count with gate 0 (so gi
stays at the last real row and ``gl`` is gi of the last real row) and are never written.

Grid and layout
---------------
One CTA per (chunk slot, head, batch): ``T.Kernel(slots, H, B)``; slots go on grid x, the
only grid dimension without the 65535 limit (C = 16 reaches it near 1M tokens). One variant
for rect and varlen: the kernel always sees a list of sequences (B == 1 at call time; a rect
batch comes flattened, :func:`torch_dplr.ops.varlen.as_one_sequence_list`). Slot c starts at
token ``chunk_start[c]`` and has ``chunk_len[c]`` rows (0 for the unused trailing slots, which
only write ``gl = 0``), the tables of :func:`torch_dplr.ops.varlen.kernel_tables`. B, T, H and
the slot count are symbolic.

Every per-column quantity (cumsum, gated outputs, exponent factors) is independent across the
K columns, so the kernel walks K in blocks of BK columns: per block it scans the gates
(two-level parallel scan: BK columns x threads/BK row segments), writes gl and the gated
outputs, builds the GEMM operands in shared memory and accumulates the C x C products in
fp32 fragments, which are masked and written once after the last block.

Two exact schemes for the decay factor 2^(gi_i - gi_j)
-----------------------------------------------------
``scheme="centred"``: factor through one centre per column, c = gl/2,
``2^(gi_i - c) * 2^(c - gi_j)``, so each matrix is ONE GEMM over K of ``q 2^(gi - c)`` (or
``a 2^(ge - c)``) with ``k 2^(c - gi)`` (or b). gi and ge lie in [gl, 0], so every exponent
is at most |gl|/2 in magnitude: in range while the chunk's total decay -gl is at most
:func:`centred_max_decay` in every column (a declared lower bound guarantees it where
:func:`centred_is_safe`; otherwise the dispatcher runs the redo form of the tiled scheme
after it, ``torch_dplr/ops/gate_bound.py``). RWKV-7's bound gives exponents up to 28 at
C = 64. Entries above the diagonal may overflow in the fragment and are discarded by the
mask (a select, so an inf never reaches an output).

``scheme="tiled"`` (any gate): two-level tiling with 16-row sub-blocks. For the column block J
(columns 16J..16J+15) and rows i of later sub-blocks, factor through e_J = gi at row 16J+15:
``q_i 2^(gi_i - e_J) * k_j 2^(e_J - gi_j)``, both exponents <= 0, one GEMM of M = C, N = 16
per (J, matrix); rows of sub-blocks <= J are zero in that operand, which is rebuilt for each
J from the raw q / a tiles in shared memory. The 16 x 16 diagonal sub-blocks run on CUDA
cores, thread = (row i, K-slice): the row's own 8-row half uses exact pairwise exponents
(clamped at 0; entries past the mask are discarded), and a second-half row sees the first
half factored through that half's last row b, ``(q_i 2^(gi_i - gi_b)) (k_j 2^(gi_b - gi_j))``,
again both <= 0, which halves the exp2 count. The K-slices are summed through shared memory
at the end. Every exp2 argument of this scheme is <= 0, for any gate.

GEMM operands are fp32 in shared memory, rounded to tf32 (round-to-nearest) when written, and
multiplied with tf32 tensor-core MMAs: 2^-11 relative per operand for both bf16 and fp16
inputs, and no fp16 range issue for the centred operands (DESIGN.md section 6).

Loads: each K block starts with one burst of copies of its five input tiles into shared
memory, all issued before anything waits: the raw q/a/k/b tiles as cp.async 16-byte copies
(rows past T zero-filled), the gates straight into the gate tile (centred fp32 gates:
cp.async; otherwise vector loads converting on the way), then one wait. The tiled scheme
widens the raw tiles into its padded fp32 tiles in a pass of its own (padded rows are not
16-byte aligned; it used to load into them directly, which held 80 loaded values per thread in
registers at once and spilled). An earlier version read the inputs inside the element-wise
passes: scalar loads behind branches and stores, one memory latency per unrolled iteration,
10% of HBM bandwidth on the H200. Rows past L are not masked at load (see ``load_tiles``). The
gates are scanned by one thread per (column, row segment), rows in batches held in registers
so that their loads overlap.

Stores (centred): every global store is a row-major vector. The C x C matrices are masked to
their triangle while they are staged in shared memory (dead operand space; rows padded by
_APAD elements against bank conflicts) and leave as 16-byte rows. With one K block (K = BK,
e.g. the design shape) the gated outputs are computed in the operand pass, wait in registers,
replace the raw tiles and leave as 16-byte rows too; with more K blocks the four accumulators
live across blocks and those registers would spill, so the gated outputs are stored from a
pass of their own (8-byte vectors). The centred gate tile has a leading zero row, so that ge
needs no select on the row (which stops the vectorization). The previous version stored the
C x C fragments element by element (2- and 4-byte stores spread over 8 rows: ~3x the L2 write
requests of whole rows) and the gated outputs as scalars; at the design shape it reached 31%
of HBM bandwidth. The tiled scheme still stores that way.

Shared memory (TileLang overlaps buffers by liveness) and occupancy at 128 threads, default
block_k (ptxas, sm_90a; no variant spills): centred C = 64, K = 64: gates 16.25 KB, raw tiles
32 KB, four fp32 operands 64 KB = 112.25 KB (the output staging reuses them), ~245 registers,
2 CTAs per SM (both limits); centred C = 32: ~57 KB, ~125-150 registers, 3 CTAs per SM;
centred C = 16 (64 threads): 14.4 KB, ~85-110 registers, 9-11 CTAs per SM; tiled C = 64
(BK = 32): seven padded fp32 C x (BK + 1) tiles, four C x BK operands and the raw tiles,
~106 KB, ~230 registers, 2 CTAs per SM. No TMA (with symbolic shapes its descriptors would be
encoded on the host every launch).

Signature (call ``kernel(*inputs, *outputs)``, nothing returned)::

    intra_fwd(q, k, a, b, gk, chunk_start, chunk_len, scale,
              gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg)

q, k, a, b [B, T, H, K] dtype; gk [B, T, H, K] gate_dtype; chunk_start, chunk_len int32
[slots]; scale a float; gl [B, slots, H, K] fp32; A_qk, A_qb [B, T, H, C] dtype; A_ak, A_ab
[B, T, H, C] fp32; qg, kg, ag, bg [B, T, H, K] dtype (B == 1 at call time).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals (K, dtype, ...) at definition time.
import itertools
import math

import tilelang.language as T

from .compile import canonical_dtype, kernel_options
from .tile_macros import (LOG2E, REDO_SPAN, broken_chunks_from, end_cta, gate_scan_from,
                          tf32)

__all__ = [
    "intra_fwd_kernel",
    "centred_is_safe",
    "centred_max_decay",
    "scheme_for",
    "variants",
    "ref_program",
    "CHUNK_SIZES",
    "HEAD_DIMS",
    "DTYPES",
    "SCHEMES",
]

CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
SCHEMES = ("centred", "tiled")

#: Largest exponent magnitude a centred operand may carry, |gl|/2 <= (C/2) |lower_bound| log2e.
#: 2^100 leaves ~2^27 of fp32 range for the operand magnitudes (|q|, |k|, ... < 1e8).
CENTRED_MAX_EXPONENT = 100.0

_SUB = 16  # sub-block size of the tiled scheme (one mma tile)
_HALF = _SUB // 2
_ACC = "float32"
_APAD = 8  # row padding (elements) of the staged C x C outputs: 16-byte rows, fewer bank conflicts


def centred_is_safe(chunk_size: int, lower_bound: float | None) -> bool:
    """True when a declared gate lower bound licenses the centred scheme at this chunk size.

    >>> centred_is_safe(64, -math.exp(-0.5))   # RWKV-7: largest exponent ~28
    True
    >>> centred_is_safe(64, -5.0), centred_is_safe(16, -5.0)
    (False, True)
    """
    if lower_bound is None or not math.isfinite(lower_bound):
        return False
    return (chunk_size // 2) * abs(lower_bound) * LOG2E <= CENTRED_MAX_EXPONENT


def centred_max_decay() -> float:
    """Largest total decay of a chunk, ``-gl`` in log2 units, that the centred scheme computes
    in range: its exponents are at most ``-gl / 2``.  Within a declared bound
    ``-gl <= C |lower_bound| log2e``; ``torch_dplr/ops/gate_bound.py`` recomputes a chunk past
    it with the tiled scheme."""
    return 2 * CENTRED_MAX_EXPONENT


def scheme_for(chunk_size: int, lower_bound: float | None) -> str:
    """The scheme a dispatcher should build for this chunk size and declared bound."""
    return "centred" if centred_is_safe(chunk_size, lower_bound) else "tiled"


def _default_threads(C: int) -> int:
    # C = 16: a 16 x 16 GEMM splits over at most two warps (m16n8 tiles).
    return 64 if C == 16 else 128


def _default_block_k(C: int, K: int, scheme: str) -> int:
    # centred: raw tiles plus four fp32 operands of C x BK (112 KB at C = 64, BK = 64, two
    # CTAs per SM); C = 16 runs 64 threads, fewer columns each. tiled: seven padded fp32
    # C x (BK + 1) tiles plus four C x BK operands, 92 KB at C = 64, BK = 32.
    return min(K, 64 if scheme == "centred" and C > 16 else 32)


@kernel_options(pass_configs=None)
def intra_fwd_kernel(
    C: int,
    K: int,
    dtype: str,
    scheme: str = "tiled",
    gate_dtype: str = "float32",
    threads: int = 0,
    block_k: int = 0,
    redo: bool = False,
):
    """prim_func ``intra_fwd(...)`` for one config (see the module docstring for the signature).

    C: chunk size (16, 32, 64); K: head dim (multiple of 16, <= 256); dtype: dtype of q, k, a,
    b and of A_qk, A_qb, qg, kg, ag, bg (bf16 / fp16); scheme: "centred" (needs a lower bound,
    :func:`scheme_for`) or "tiled" (any gate); gate_dtype: dtype of gk (fp32 or dtype).
    Schedule knobs (same results): threads (0 picks the default), block_k (K columns per
    block, 0 picks the default).

    redo (tiled only): the exact recompute after the centred kernel (``torch_dplr/ops/
    gate_bound.py``). ``gl`` then holds the centred kernel's chunk totals on entry; each CTA
    covers ``REDO_SPAN`` chunks of a head, tests their totals at once and computes only the
    chunks where some column decays past :func:`centred_max_decay` (they broke the declared
    bound), one after another; every other chunk, and every empty slot, is left as the
    centred kernel wrote it.
    """
    dtype = canonical_dtype(dtype)
    gate_dtype = canonical_dtype(gate_dtype)
    if C not in CHUNK_SIZES:
        raise ValueError(f"chunk size C={C} not in {CHUNK_SIZES}")
    if K % 16 or not 16 <= K <= 256:
        raise ValueError(f"K={K}: need a multiple of 16 in [16, 256]")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if gate_dtype not in (_ACC, dtype):
        raise ValueError(f"gate_dtype={gate_dtype}: must be float32 or the input dtype {dtype}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} not in {SCHEMES}")
    if redo and scheme != "tiled":
        raise ValueError("redo: only the tiled scheme recomputes chunks that broke the bound")
    threads = threads or _default_threads(C)
    BK = block_k or _default_block_k(C, K, scheme)
    if K % BK or BK % 8:
        raise ValueError(f"block_k={BK} must divide K={K} and be a multiple of 8")
    if threads % 32 or threads % BK or threads < BK:
        raise ValueError(f"threads={threads}: need a multiple of 32 and of block_k={BK}")
    if threads % C:
        raise ValueError(f"threads={threads} must be a multiple of C={C}")

    centred = scheme == "centred"
    nb = C // _SUB  # sub-blocks per chunk
    NSEG = threads // BK  # row segments of the gate scan
    if C % NSEG:
        raise ValueError(f"threads/block_k={NSEG} must divide C={C}")
    SL = C // NSEG  # rows per scan segment
    S = threads // C  # K-slices of the diagonal sub-block work (tiled)
    if not centred and (BK % S or _SUB % S):
        raise ValueError(f"threads/C={S} must divide block_k={BK} and {_SUB}")
    KS = BK // S
    JS = _SUB // S
    n_kb = K // BK
    f32 = _ACC
    # Python tuples: the TileLang frontend unrolls loops over them while building the IR
    # (a `for ... in range(...)` inside a macro becomes a device loop).
    OFF_BLOCKS = tuple(range(nb - 1))  # column blocks with an off-diagonal GEMM
    ALL_BLOCKS = tuple(range(nb))
    MATS = (0, 1, 2, 3)  # A_qk, A_qb, A_ak, A_ab

    B, Tn, H, NS = T.dynamic("B, T, H, NS")

    o = 1 if centred else 0  # centred: G has a leading zero row, row r + 1 holds gi of row r
    SB = min(SL, _SUB)  # scan rows loaded into registers at once
    # centred, one K block: the gated outputs are staged in shared memory for 16-byte stores
    # (with more K blocks the four accumulators live across blocks and the staging registers
    # would spill)
    stage_gated = centred and n_kb == 1

    def gi_at(G, r, c):
        return G[r + o, c]

    def ge_at(G, r, c):
        """ge of row r (gi of row r - 1, 0 at row 0): centred reads the zero row, no select
        (a select on r stops the vectorization of the gated-output stores)."""
        if centred:
            return G[r, c]
        return T.if_then_else(r > 0, G[r - 1, c], T.float32(0))

    @T.macro
    def load_tiles(q, k, a, b, gk, i_b, i_h, t0, k0, G, q_t, a_t, k_t, b_t):
        """Every input tile of a K block in one burst, then one wait: the raw q/a/k/b tiles
        as cp.async 16-byte copies (rows past T zero-filled; tiled: widened to the padded fp32
        tiles afterwards by ``widen_tiles``), the gates straight into G (centred fp32 gates:
        cp.async; otherwise vector loads converting on the way: the tiled G has padded rows,
        not 16-byte aligned, and a separate raw gate tile would cost the tiled C = 64 variant
        its second CTA per SM).

        Rows past L hold another sequence's tokens (or lie past T and read as 0). They are
        not masked: the scan zeroes their gates, the gated outputs are not stored there, and
        in the products a row past L only reaches row or column r >= L of a matrix, which is
        either not stored or above the diagonal of a stored row (discarded by a select, so
        even a non-finite value cannot leak)."""
        T.async_copy(q[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], q_t)
        T.async_copy(a[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], a_t)
        T.async_copy(k[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], k_t)
        T.async_copy(b[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], b_t)
        if centred and gate_dtype == f32:
            T.async_copy(gk[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], G[1 : C + 1, :])
        else:
            T.copy(gk[i_b, t0 : t0 + C, i_h, k0 : k0 + BK], G[o : C + o, 0:BK])
        T.ptx_wait_group(0)
        T.sync_threads()

    @T.macro
    def widen_tiles(q_t, a_t, k_t, b_t, qS, aS, kS, bS):
        """Tiled: the raw input tiles to the padded fp32 tiles the scheme works on (separate
        buffers: an in-place pass would get a barrier per iteration)."""
        for r, c in T.Parallel(C, BK):
            qS[r, c] = T.Cast(f32, q_t[r, c])
            aS[r, c] = T.Cast(f32, a_t[r, c])
            kS[r, c] = T.Cast(f32, k_t[r, c])
            bS[r, c] = T.Cast(f32, b_t[r, c])

    # gates in log2 units (0 past L), scanned down the rows in place
    gate_scan = gate_scan_from(C, BK, NSEG, SB, o, centred)
    broken_chunks = broken_chunks_from(K, threads, REDO_SPAN)  # the redo form's test

    @T.macro
    def store_rows(src, dst, i_b, i_h, t0, L, c0, W):
        """Columns 0..W-1 of a staged tile to dst's columns c0..c0+W-1, rows < L only:
        row-major 16-byte vector stores."""
        for r, c in T.Parallel(C, W):
            if r < L:
                dst[i_b, t0 + r, i_h, c0 + c] = src[r, c]

    @T.macro
    def body(q, k, a, b, gk, scale, gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg, i_b, i_c, i_h, t0, L):
        tx = T.get_thread_binding()
        # gates -> gi (log2). Tiled: padded columns, the diagonal work reads it down columns.
        # Centred: unpadded columns, so that the element-wise passes vectorize their global
        # accesses, and a leading zero row (ge without a select).
        G = T.alloc_shared((C + o, BK + (0 if centred else 1)), f32)
        Tot = T.alloc_shared((NSEG, BK), f32) if NSEG > 1 else None
        run = T.alloc_local((1,), f32)
        vals = T.alloc_local((SB,), f32)
        if centred:
            Qc = T.alloc_shared((C, BK), f32)
            Ac = T.alloc_shared((C, BK), f32)
            Kc = T.alloc_shared((C, BK), f32)
            Bc = T.alloc_shared((C, BK), f32)
            F_qk = T.alloc_fragment((C, C), f32)
            F_qb = T.alloc_fragment((C, C), f32)
            F_ak = T.alloc_fragment((C, C), f32)
            F_ab = T.alloc_fragment((C, C), f32)
            T.clear(F_qk)
            T.clear(F_qb)
            T.clear(F_ak)
            T.clear(F_ab)
            # raw inputs of the K block (the operands are built from them in separate buffers:
            # an in-place T.Parallel pass would get a barrier per iteration)
            q_t = T.alloc_shared((C, BK), dtype)
            a_t = T.alloc_shared((C, BK), dtype)
            k_t = T.alloc_shared((C, BK), dtype)
            b_t = T.alloc_shared((C, BK), dtype)
            if stage_gated:  # gated outputs on their way from the operand pass to the raw tiles
                Rq = T.alloc_fragment((C, BK), dtype)
                Ra = T.alloc_fragment((C, BK), dtype)
                Rk = T.alloc_fragment((C, BK), dtype)
                Rb = T.alloc_fragment((C, BK), dtype)
        else:
            # off-diagonal operands of the current column block J (built one J at a time):
            # X / Y q- / a-side rows of sub-blocks > J; Kr / Br k- / b-side factored to the
            # end of their own sub-block.
            if nb > 1:
                X = T.alloc_shared((C, BK), f32)
                Y = T.alloc_shared((C, BK), f32)
                Kr = T.alloc_shared((C, BK), f32)
                Br = T.alloc_shared((C, BK), f32)
            F = [[T.alloc_fragment((C, _SUB), f32) for _ in range(4)] for _ in range(nb - 1)]
            for J in OFF_BLOCKS:
                for m in MATS:
                    T.clear(F[J][m])
            # q, a, k, b widened to fp32 and the k / b of first halves factored to the half's
            # end (kF, bF); padded rows: the diagonal work reads them down columns without bank
            # conflicts
            qS = T.alloc_shared((C, BK + 1), f32)
            aS = T.alloc_shared((C, BK + 1), f32)
            kS = T.alloc_shared((C, BK + 1), f32)
            bS = T.alloc_shared((C, BK + 1), f32)
            kF = T.alloc_shared((C, BK + 1), f32)
            bF = T.alloc_shared((C, BK + 1), f32)
            # the raw input tiles as loaded (widened to qS..bS before anything else)
            q_t = T.alloc_shared((C, BK), dtype)
            a_t = T.alloc_shared((C, BK), dtype)
            k_t = T.alloc_shared((C, BK), dtype)
            b_t = T.alloc_shared((C, BK), dtype)
            accE = T.alloc_local((4 * _HALF,), f32)  # own half, exact exponents
            accF = T.alloc_local((4 * _HALF,), f32)  # first half seen from the second
            w = T.alloc_local((2,), f32)
            for u in T.unroll(4 * _HALF):
                accE[u] = T.float32(0)
                accF[u] = T.float32(0)

        for kb in T.serial(n_kb):
            k0 = kb * BK
            load_tiles(q, k, a, b, gk, i_b, i_h, t0, k0, G, q_t, a_t, k_t, b_t)
            if not centred:
                widen_tiles(q_t, a_t, k_t, b_t, qS, aS, kS, bS)
            gate_scan(L, tx, G, Tot, run, vals)

            for c in T.Parallel(BK):
                gl[i_b, i_c, i_h, k0 + c] = G[C - 1 + o, c]

            if stage_gated:
                # ---- GEMM operands and gated outputs (qg = scale q 2^gi, ag = a 2^ge, kg / bg
                # = k / b 2^(gl - gi)) in one pass over the raw tiles. The gated values wait in
                # registers, replace the raw tiles once every thread is past them, and leave
                # from there as row-major 16-byte vector stores ----
                for r, c in T.Parallel(C, BK):
                    gi = gi_at(G, r, c)
                    ge = ge_at(G, r, c)
                    gm = G[C - 1 + o, c] * 0.5  # the centre, gl / 2
                    to_end = T.exp2(G[C - 1 + o, c] - gi)
                    qv = T.Cast(f32, q_t[r, c])
                    av = T.Cast(f32, a_t[r, c])
                    kv = T.Cast(f32, k_t[r, c])
                    bv = T.Cast(f32, b_t[r, c])
                    Rq[r, c] = T.Cast(dtype, qv * scale * T.exp2(gi))
                    Ra[r, c] = T.Cast(dtype, av * T.exp2(ge))
                    Rk[r, c] = T.Cast(dtype, kv * to_end)
                    Rb[r, c] = T.Cast(dtype, bv * to_end)
                    Qc[r, c] = tf32(qv * T.exp2(gi - gm))
                    Ac[r, c] = tf32(av * T.exp2(ge - gm))
                    f = T.exp2(gm - gi)
                    Kc[r, c] = tf32(kv * f)
                    Bc[r, c] = tf32(bv * f)
                T.sync_threads()
                for r, c in T.Parallel(C, BK):
                    q_t[r, c] = Rq[r, c]
                    a_t[r, c] = Ra[r, c]
                    k_t[r, c] = Rk[r, c]
                    b_t[r, c] = Rb[r, c]
                T.sync_threads()
                store_rows(q_t, qg, i_b, i_h, t0, L, k0, BK)
                store_rows(a_t, ag, i_b, i_h, t0, L, k0, BK)
                store_rows(k_t, kg, i_b, i_h, t0, L, k0, BK)
                store_rows(b_t, bg, i_b, i_h, t0, L, k0, BK)
            else:
                # ---- gated outputs, stored straight from the pass (centred: vectorized, as
                # no select depends on the column; tiled: scalar, from the widened tiles, so
                # that the raw ones are dead by now) ----
                if not centred:
                    q_t, a_t, k_t, b_t = qS, aS, kS, bS
                for r, c in T.Parallel(C, BK):
                    if r < L:
                        gi = gi_at(G, r, c)
                        to_end = T.exp2(G[C - 1 + o, c] - gi)
                        qg[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, T.Cast(f32, q_t[r, c]) * scale * T.exp2(gi))
                        ag[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, T.Cast(f32, a_t[r, c]) * T.exp2(ge_at(G, r, c)))
                        kg[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, T.Cast(f32, k_t[r, c]) * to_end)
                        bg[i_b, t0 + r, i_h, k0 + c] = T.Cast(dtype, T.Cast(f32, b_t[r, c]) * to_end)
                # ---- GEMM operands ----
                if centred:
                    for r, c in T.Parallel(C, BK):
                        gi = gi_at(G, r, c)
                        gm = G[C - 1 + o, c] * 0.5  # the centre, gl / 2
                        Qc[r, c] = tf32(T.Cast(f32, q_t[r, c]) * T.exp2(gi - gm))
                        Ac[r, c] = tf32(T.Cast(f32, a_t[r, c]) * T.exp2(ge_at(G, r, c) - gm))
                        f = T.exp2(gm - gi)
                        Kc[r, c] = tf32(T.Cast(f32, k_t[r, c]) * f)
                        Bc[r, c] = tf32(T.Cast(f32, b_t[r, c]) * f)
                else:
                    for r, c in T.Parallel(C, BK):
                        gi = G[r, c]
                        if nb > 1:
                            f = T.exp2(G[(r // _SUB) * _SUB + _SUB - 1, c] - gi)
                            Kr[r, c] = tf32(kS[r, c] * f)
                            Br[r, c] = tf32(bS[r, c] * f)
                        if r % _SUB < _HALF:
                            f = T.exp2(G[(r // _SUB) * _SUB + _HALF - 1, c] - gi)
                            kF[r, c] = kS[r, c] * f
                            bF[r, c] = bS[r, c] * f
                T.sync_threads()

            # ---- tensor-core products ----
            if centred:
                T.gemm(Qc, Kc, F_qk, transpose_B=True)
                T.gemm(Qc, Bc, F_qb, transpose_B=True)
                T.gemm(Ac, Kc, F_ak, transpose_B=True)
                T.gemm(Ac, Bc, F_ab, transpose_B=True)
            else:
                for J in OFF_BLOCKS:
                    # rows of sub-blocks > J factored through e_J = gi at row 16J + 15
                    e_row = J * _SUB + _SUB - 1
                    for r, c in T.Parallel(C, BK):
                        if r // _SUB > J:
                            X[r, c] = tf32(qS[r, c] * T.exp2(G[r, c] - G[e_row, c]))
                            Y[r, c] = tf32(aS[r, c] * T.exp2(G[r - 1, c] - G[e_row, c]))
                        else:
                            X[r, c] = T.float32(0)
                            Y[r, c] = T.float32(0)
                    T.sync_threads()
                    rows = slice(J * _SUB, (J + 1) * _SUB)
                    T.gemm(X, Kr[rows, :], F[J][0], transpose_B=True)
                    T.gemm(X, Br[rows, :], F[J][1], transpose_B=True)
                    T.gemm(Y, Kr[rows, :], F[J][2], transpose_B=True)
                    T.gemm(Y, Br[rows, :], F[J][3], transpose_B=True)
                    T.sync_threads()
                # ---- diagonal sub-blocks, thread = (row i, K-slice s) ----
                # own half (columns 8h..8h+7 of the sub-block): exact pairwise exponents;
                # second-half rows also see the first half, factored through its last row
                # (q_i 2^(gi_i - gi_b)) (k_j 2^(gi_b - gi_j)), both exponents <= 0.
                i = tx % C
                s = tx // C
                j0 = (i // _SUB) * _SUB
                h = (i % _SUB) // _HALF
                jE = j0 + h * _HALF
                for m in T.serial(KS):
                    c = s * KS + m
                    g_i = G[i, c]
                    g_e = T.if_then_else(i > 0, G[T.max(i - 1, 0), c], T.float32(0))
                    q_i = qS[i, c]
                    a_i = aS[i, c]
                    for jj in T.unroll(_HALF):
                        g_j = G[jE + jj, c]
                        k_j = kS[jE + jj, c]
                        b_j = bS[jE + jj, c]
                        # (a local buffer, so that each factor is computed once)
                        w[0] = q_i * T.exp2(T.min(g_i - g_j, T.float32(0)))
                        w[1] = a_i * T.exp2(T.min(g_e - g_j, T.float32(0)))
                        accE[jj] = accE[jj] + w[0] * k_j
                        accE[_HALF + jj] = accE[_HALF + jj] + w[0] * b_j
                        accE[2 * _HALF + jj] = accE[2 * _HALF + jj] + w[1] * k_j
                        accE[3 * _HALF + jj] = accE[3 * _HALF + jj] + w[1] * b_j
                    if h > 0:
                        g_b = G[j0 + _HALF - 1, c]
                        w[0] = q_i * T.exp2(T.min(g_i - g_b, T.float32(0)))
                        w[1] = a_i * T.exp2(T.min(g_e - g_b, T.float32(0)))
                        for jj in T.unroll(_HALF):
                            kf = kF[j0 + jj, c]
                            bf = bF[j0 + jj, c]
                            accF[jj] = accF[jj] + w[0] * kf
                            accF[_HALF + jj] = accF[_HALF + jj] + w[0] * bf
                            accF[2 * _HALF + jj] = accF[2 * _HALF + jj] + w[1] * kf
                            accF[3 * _HALF + jj] = accF[3 * _HALF + jj] + w[1] * bf
            T.sync_threads()

        # ---- masked writes: staged in shared memory (the operand tiles are dead by now), so
        # that the global stores are row-major 16-byte vectors, not scattered fragment
        # elements ----
        if centred:
            # padded rows spread the fragment-layout writes over the banks and keep the rows
            # 16-byte aligned
            S_qk = T.alloc_shared((C, C + _APAD), dtype)
            S_qb = T.alloc_shared((C, C + _APAD), dtype)
            S_ak = T.alloc_shared((C, C + _APAD), f32)
            S_ab = T.alloc_shared((C, C + _APAD), f32)
            for r, c in T.Parallel(C, C):
                S_qk[r, c] = T.Cast(dtype, T.if_then_else(c <= r, F_qk[r, c] * scale, T.float32(0)))
                S_qb[r, c] = T.Cast(dtype, T.if_then_else(c <= r, F_qb[r, c] * scale, T.float32(0)))
                S_ak[r, c] = T.if_then_else(c < r, F_ak[r, c], T.float32(0))
                S_ab[r, c] = T.if_then_else(c < r, F_ab[r, c], T.float32(0))
            T.sync_threads()
            store_rows(S_qk, A_qk, i_b, i_h, t0, L, 0, C)
            store_rows(S_qb, A_qb, i_b, i_h, t0, L, 0, C)
            store_rows(S_ak, A_ak, i_b, i_h, t0, L, 0, C)
            store_rows(S_ab, A_ab, i_b, i_h, t0, L, 0, C)
        else:
            # off-diagonal column blocks (and the zeros above the diagonal blocks)
            outs = (A_qk, A_qb, A_ak, A_ab)
            for J in ALL_BLOCKS:
                for mi in MATS:
                    out = outs[mi]
                    for r, c in T.Parallel(C, _SUB):
                        if r < L:
                            if J < nb - 1:
                                if r // _SUB > J:
                                    v = F[J][mi][r, c] * scale if mi < 2 else F[J][mi][r, c]
                                    out[i_b, t0 + r, i_h, J * _SUB + c] = T.Cast(out.dtype, v)
                            if r // _SUB < J:
                                out[i_b, t0 + r, i_h, J * _SUB + c] = T.Cast(out.dtype, T.float32(0))
            # diagonal blocks: sum the K-slices through shared memory, one matrix at a time
            Red = T.alloc_shared((S, C, _SUB + 1), f32)
            i = tx % C
            s = tx // C
            j0 = (i // _SUB) * _SUB
            h = (i % _SUB) // _HALF
            for mi in MATS:
                out = outs[mi]
                # columns of the sub-block: first half exact (h = 0) or factored (h = 1),
                # second half exact (h = 1) or above the diagonal (h = 0)
                for jj in T.unroll(_HALF):
                    Red[s, i, jj] = T.if_then_else(h > 0, accF[mi * _HALF + jj], accE[mi * _HALF + jj])
                    Red[s, i, _HALF + jj] = T.if_then_else(h > 0, accE[mi * _HALF + jj], T.float32(0))
                T.sync_threads()
                for u in T.unroll(JS):
                    jj = s * JS + u
                    run[0] = T.float32(0)
                    for p in T.unroll(S):
                        run[0] = run[0] + Red[p, i, jj]
                    if i < L:
                        keep = (jj <= i - j0) if mi < 2 else (jj < i - j0)
                        v = run[0] * scale if mi < 2 else run[0]
                        out[i_b, t0 + i, i_h, j0 + jj] = T.Cast(out.dtype, T.if_then_else(keep, v, T.float32(0)))
                T.sync_threads()

    @T.prim_func
    def intra_fwd(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        a: T.Tensor((B, Tn, H, K), dtype),
        b: T.Tensor((B, Tn, H, K), dtype),
        gk: T.Tensor((B, Tn, H, K), gate_dtype),
        chunk_start: T.Tensor((NS,), "int32"),
        chunk_len: T.Tensor((NS,), "int32"),
        scale: T.float32,
        gl: T.Tensor((B, NS, H, K), _ACC),
        A_qk: T.Tensor((B, Tn, H, C), dtype),
        A_qb: T.Tensor((B, Tn, H, C), dtype),
        A_ak: T.Tensor((B, Tn, H, C), _ACC),
        A_ab: T.Tensor((B, Tn, H, C), _ACC),
        qg: T.Tensor((B, Tn, H, K), dtype),
        kg: T.Tensor((B, Tn, H, K), dtype),
        ag: T.Tensor((B, Tn, H, K), dtype),
        bg: T.Tensor((B, Tn, H, K), dtype),
    ):
        if redo:
            # one CTA per REDO_SPAN chunks of a head: it tests all their totals at once and
            # recomputes only the chunks that broke the bound, so a call where none did costs
            # a few waves of short CTAs instead of one CTA per (chunk, head)
            with T.Kernel(T.ceildiv(NS, REDO_SPAN), H, B, threads=threads) as (bx, i_h, i_b):
                c0 = bx * REDO_SPAN
                flags = T.alloc_shared((REDO_SPAN,), "int32")
                slots = T.alloc_shared((REDO_SPAN,), "int32")
                count = T.alloc_shared((1,), "int32")
                broken_chunks(gl, chunk_len, i_b, c0, NS, i_h, -centred_max_decay(), flags,
                              slots, count)
                # the list in registers: a loop bound or index read from shared memory inside
                # the loop would need barriers TileLang cannot place
                n = T.alloc_local((1,), "int32")
                i_c = T.alloc_local((1,), "int32")
                n[0] = count[0]
                for i in T.serial(n[0]):
                    i_c[0] = slots[i]
                    body(q, k, a, b, gk, scale, gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg, i_b,
                         i_c[0], i_h, chunk_start[i_c[0]], chunk_len[i_c[0]])
                    T.sync_threads()  # the next chunk's loads reuse the shared tiles
        else:
            with T.Kernel(NS, H, B, threads=threads) as (i_c, i_h, i_b):
                t0 = chunk_start[i_c]
                L = chunk_len[i_c]
                if not centred:
                    if L == 0:  # an empty slot only writes gl = 0
                        for c in T.Parallel(K):
                            gl[i_b, i_c, i_h, c] = T.float32(0)
                        end_cta()
                body(q, k, a, b, gk, scale, gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg, i_b, i_c,
                     i_h, t0, L)

    return intra_fwd


def variants():
    """Every config the dispatch can build (the compile test builds them all, the GPU test
    runs them): C x K x dtype x scheme x gate dtype (fp32, or the input dtype), and the tiled
    scheme's redo form of each."""
    for C, K, dt, scheme in itertools.product(CHUNK_SIZES, HEAD_DIMS, DTYPES, SCHEMES):
        for gate_dtype in (_ACC, dt):
            yield dict(C=C, K=K, dtype=dt, scheme=scheme, gate_dtype=gate_dtype)
            if scheme == "tiled":  # the exact recompute behind a centred kernel
                yield dict(C=C, K=K, dtype=dt, scheme=scheme, gate_dtype=gate_dtype, redo=True)


def ref_program(q, k, a, b, gk, cu_seqlens, scale, chunk_size, lower_bound=float("-inf")):
    """The contract: ``chunk_intra_fwd_reference`` (plain PyTorch, fp32 math), same outputs."""
    from torch_dplr.ops.intra import chunk_intra_fwd_reference

    return chunk_intra_fwd_reference(q, k, a, b, gk, cu_seqlens, scale, chunk_size, lower_bound)
