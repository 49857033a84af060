"""WY stage backward (``dplr::chunk_wy_bwd``): dA_ab, dA_ak, dag, dv from A_ab_inv, dw, du.

Contract: :func:`torch_dplr.ops.wy.chunk_wy_bwd_reference` (math in
``torch_dplr/reference/wy.py``). Per chunk of C rows, with Inv = A_ab_inv from the forward
(used as given) and Ak = strict_lower(A_ak):

    dag   = Inv^T dw                 m = Ak v            dm = Inv^T du
    dA_ak = strict_lower(dm v^T)     dv = Ak^T dm
    dA_inv = dw ag^T + du m^T        dA_ab = strict_lower(Inv^T dA_inv Inv^T)

Evaluation order: no C x K intermediates
----------------------------------------
Re-associated so that every intermediate is C x C (cheap to keep in shared memory) and
the products with the data are few:

    Z1 = dw ag^T       Z2 = du v^T       Q = Inv Ak
    dag   = Inv^T dw                     dv    = Q^T du            (= Ak^T Inv^T du)
    P     = Inv^T Z2                     dA_ak = strict_lower(P)   (P = dm v^T)
    X     = Inv^T Z1 + P Ak^T            dA_ab = strict_lower(X Inv^T)   (X = Inv^T dA_inv)

That is 4 products C x C x K (dag, dv, Z1, Z2; a split product counted once) and 5 of
C x C x C, against 7 and 2 for the literal order, and no C x K intermediate at all, so
shared memory stays small (64 KB at C = 64, K = V = 128). With the splits below: 6 + 15
tensor-core GEMMs per chunk.

Grid: one CTA per (chunk slot, head) on grid x, head fastest (neighbouring CTAs read
neighbouring bytes of a token row), times B on grid y. Slot s covers rows
chunk_start[s] .. chunk_start[s] + chunk_len[s] - 1 (the tables of
:func:`torch_dplr.ops.varlen.kernel_tables`; a rect batch is passed as the sequence list of
its flattened [1, B*T] view). Rows past chunk_len are zero in every operand: they are never
read (next sequence, or past T) and never written; a slot with chunk_len 0 does nothing.
Each input row is read once and each output row written once; no atomics, no TMA (its
descriptors would be encoded on the host at every launch with symbolic shapes).

Per CTA, in this order (so that few tiles are live at a time)::

    load Inv, dw, ag      dag = Inv^T dw -> out,  Z1 = dw ag^T;   X = Inv^T Z1
    load Ak               Q = Inv Ak
    load du               dv = Q^T du -> out
    load v                Z2 = du v^T;  P = Inv^T Z2 -> dA_ak;  X += P Ak^T;  X Inv^T -> dA_ab

Precision (tensor cores take 16-bit operands; the C x C matrices are fp32)
-------------------------------------------------------------------------
As in the forward (:mod:`csrc_tl.wy_fwd`), an fp32 factor x enters a GEMM as two 16-bit
terms hi = r(x), lo = r(x - hi), accumulated in fp32:

* fp32 x fp32 (Inv, Ak, Z1, Z2, P, X): bf16 hi/lo on both sides, three GEMMs
  (Xl Yh + Xh Yl + Xh Yh; the dropped lo*lo term is ~2^-18 relative). bf16 keeps fp32's
  range, which matters for Z1, Z2, P, X: products of gradients, unbounded in magnitude.
* fp32 x data (dag = Inv^T dw, dv = Q^T du): the fp32 factor split into two terms of the
  data dtype, two GEMMs, the data exact, as the forward does for w = Inv ag and u = Q v
  (for fp16 those are the very factors the forward splits to fp16, Inv and Q = Inv Ak,
  so fp16 sees the forward's range, nothing new).
* data x data (Z1, Z2): one GEMM, exact products in fp32.

What each output sees: dag and dv carry fp32-accurate sums (~2^-16 relative, from the hi/lo
terms) rounded once to the data dtype; dA_ak (one split product of the exact Z2) and dA_ab
(three chained split products) are stored in fp32. A CPU emulation of exactly these
roundings against the fp32 reference (RMS(err)/RMS(ref), T = 2048, every C and K, RWKV-7
and unbounded gates) gives dA_ab <= 5.6e-6, dA_ak <= 2.5e-6, and for dag / dv, rounded by
both sides, 4.5e-5 / 1.2e-4 (bf16) and 1.0e-5 / 3.7e-5 (fp16) -- against 1.7e-3 (bf16) and
2.1e-4 (fp16) for the output rounding itself. Data dtypes: bf16 and fp16 (no fp32 data).

Resources (sm_90a, nvcc 13, default schedules; bf16 and fp16 alike; no spills)
-----------------------------------------------------------------------------
TileLang overlaps shared buffers by liveness (the C x C pairs above are built one after the
other; data tiles die after their last product).

    C   K=V  threads  shared   registers   CTAs (warps) per SM, limited by registers
    16   64     64     7 KB        56        18 (36)
    16  128     64    11 KB        86        11 (22)
    32   64    128    16 KB        80         6 (24)
    32  128    128    28 KB       117         4 (16)
    64   64    256    56 KB        96         2 (16)
    64  128    256    64 KB   112 / 110      2 (16)     (bf16 / fp16)

GEMMs: wgmma at C = 64 (M = 64 per warpgroup, N split over the two; the GEMMs of one step
are issued back to back with one wait), mma.sync m16n8k16 at C <= 32; operands in
swizzled shared memory, transposes via the operand major-ness (ldmatrix.trans / wgmma
MN-major descriptors), never materialized.

Signature (call ``kernel(*inputs, *outputs)``, nothing returned)::

    wy_bwd(A_ab_inv, A_ak, ag, v, dw, du, chunk_start, chunk_len, dA_ab, dA_ak, dag, dv)

A_ab_inv, A_ak, dA_ab, dA_ak [B, T, H, C] fp32 (row = token, column = position in its
chunk; dA_ab / dA_ak are 0 on and above the diagonal); ag, dw, dag [B, T, H, K] and v, du,
dv [B, T, H, V] dtype; chunk_start, chunk_len int32 [S]. B (1 at call time), T, H and S are
symbolic: no recompile for a new size or sequence list.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals (B, Tn, H, NS, K, dtype, ...) at definition time.
import itertools

import tilelang.language as T

from .compile import canonical_dtype

__all__ = ["wy_bwd_kernel", "ref_program", "CHUNK_SIZES", "HEAD_DIMS", "DTYPES", "variants"]

#: Sizes the kernel is built and tested for.
CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")

_ACC = "float32"
_SPLIT = "bfloat16"  # dtype of the hi/lo terms of fp32 x fp32 products

# Default schedule per chunk size: (threads, min_blocks). Not yet measured on the GPU.
# C = 64: two warpgroups, every GEMM a wgmma (M = 64, N split between the warpgroups):
# 112 registers, so 2 CTAs (16 warps) per SM; one warpgroup needs 186 registers (8 warps
# per SM), or spills under a 3-CTA cap. C <= 32: mma.sync; a 16 x 16 GEMM splits over at
# most 2 warps (m16n8 tiles), a 32 x 32 one over 8; C = 32 with 4 warps: 117 registers
# (2 warps: 127, fewer warps per SM).
_SCHEDULES = {16: (64, 0), 32: (128, 0), 64: (256, 0)}


def wy_bwd_kernel(C: int, K: int, V: int, dtype: str, threads: int | None = None,
                  min_blocks: int | None = None):
    """prim_func ``wy_bwd(A_ab_inv, A_ak, ag, v, dw, du, chunk_start, chunk_len, dA_ab, dA_ak,
    dag, dv)`` for one config (see the module docstring).

    C: chunk size (16, 32, 64); K, V: head dims of ag / dw and v / du (multiples of 16,
    <= 256); dtype: the data dtype (bf16 / fp16). Schedule knobs (None: the per-C default in
    _SCHEDULES; results do not depend on them): threads; min_blocks > 0 asks nvcc to fit
    that many CTAs per SM (caps registers).
    """
    dtype = canonical_dtype(dtype)
    if C not in CHUNK_SIZES:
        raise ValueError(f"chunk size C={C} not in {CHUNK_SIZES}")
    for name, d in (("K", K), ("V", V)):
        if d % 16 or not 16 <= d <= 256:
            raise ValueError(f"{name}={d}: need a multiple of 16 in [16, 256]")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    d_threads, d_min = _SCHEDULES[C]
    threads = d_threads if threads is None else threads
    min_blocks = d_min if min_blocks is None else min_blocks
    if threads % 32 or threads < 32:
        raise ValueError(f"threads={threads}: need a multiple of 32")
    if C < 64 and threads // 32 > (C // 16) * (C // 8):
        # mma.sync tiles are m16n8: a C x C GEMM gives each warp at least one
        raise ValueError(f"threads={threads}: C={C} x {C} GEMMs cannot be split over {threads // 32} warps")

    if C == 64 and threads % 128:
        raise ValueError(f"threads={threads}: C=64 runs whole warpgroups (wgmma)")
    share_inv = dtype == _SPLIT  # one bf16 hi/lo pair of Inv serves every product
    # wgmma (C = 64): the GEMMs of one step are issued back to back and waited for once
    use_wgmma = C == 64
    ASYNC = {"wg_wait": -1} if use_wgmma else None

    B, Tn, H, NS = T.dynamic("B, T, H, NS")

    @T.macro
    def split(src, hi, lo):
        # hi + lo == src to ~2^-17 (bf16) / ~2^-22 (fp16) relative; src fp32 (shared or fragment)
        for i, j in T.Parallel(*src.shape):
            hi[i, j] = T.Cast(hi.dtype, src[i, j])
            lo[i, j] = T.Cast(lo.dtype, src[i, j] - T.Cast(_ACC, T.Cast(hi.dtype, src[i, j])))

    @T.macro
    def gemm1(X, Y, acc, tA=False, tB=False):
        # acc += X Y, issued only (see join)
        T.gemm(X, Y, acc, transpose_A=tA, transpose_B=tB, annotations=ASYNC)

    @T.macro
    def gemm2(Xh, Xl, Y, acc, tA=False, tB=False):
        # acc += X Y, X split (fp32 x data); small term first
        gemm1(Xl, Y, acc, tA, tB)
        gemm1(Xh, Y, acc, tA, tB)

    @T.macro
    def gemm3(Xh, Xl, Yh, Yl, acc, tA=False, tB=False):
        # acc += X Y with both factors split (fp32 x fp32); small terms first
        gemm1(Xl, Yh, acc, tA, tB)
        gemm1(Xh, Yl, acc, tA, tB)
        gemm1(Xh, Yh, acc, tA, tB)

    @T.macro
    def join():
        # wait for the issued wgmmas (mma.sync at C <= 32 is synchronous already)
        if use_wgmma:
            T.wait_wgmma(0)

    @T.macro
    def load_rows(src, i_b, i_h, t0, L, dst):
        # dst = the chunk's rows of src, zero past the slot's L rows (never read there)
        for i, j in T.Parallel(*dst.shape):
            dst[i, j] = T.if_then_else(i < L, src[i_b, t0 + i, i_h, j], T.Cast(dst.dtype, 0))

    @T.macro
    def load_inv(A_inv, i_b, i_h, t0, L, Ih, Il, Idh, Idl):
        # Inv rows (as given, zero past L) -> bf16 hi/lo (and data-dtype hi/lo for fp16)
        for i, j in T.Parallel(C, C):
            x = T.if_then_else(i < L, A_inv[i_b, t0 + i, i_h, j], T.float32(0))
            Ih[i, j] = T.Cast(_SPLIT, x)
            Il[i, j] = T.Cast(_SPLIT, x - T.Cast(_ACC, T.Cast(_SPLIT, x)))
            if not share_inv:
                Idh[i, j] = T.Cast(dtype, x)
                Idl[i, j] = T.Cast(dtype, x - T.Cast(_ACC, T.Cast(dtype, x)))

    @T.macro
    def load_ak(A_ak, i_b, i_h, t0, L, Akh, Akl):
        # strict_lower(A_ak) rows, zero past L -> bf16 hi/lo (the per-element mask keeps
        # these loads scalar; they are still coalesced)
        for i, j in T.Parallel(C, C):
            a = T.if_then_else((i > j) and (i < L), A_ak[i_b, t0 + i, i_h, j], T.float32(0))
            Akh[i, j] = T.Cast(_SPLIT, a)
            Akl[i, j] = T.Cast(_SPLIT, a - T.Cast(_ACC, T.Cast(_SPLIT, a)))

    @T.macro
    def store_rows(src, dst, i_b, i_h, t0, L):
        # the slot's L rows of a fragment -> global; nothing past L
        for i, j in T.Parallel(*src.shape):
            if i < L:
                dst[i_b, t0 + i, i_h, j] = T.Cast(dst.dtype, src[i, j])

    @T.macro
    def store_strict_lower(src, dst, i_b, i_h, t0, L):
        # rows < L of a C x C fragment, 0 on and above the diagonal
        for i, j in T.Parallel(C, C):
            if i < L:
                dst[i_b, t0 + i, i_h, j] = T.if_then_else(j < i, src[i, j], T.float32(0))

    @T.prim_func
    def wy_bwd(
        A_inv: T.Tensor((B, Tn, H, C), _ACC),
        A_ak: T.Tensor((B, Tn, H, C), _ACC),
        ag: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, H, V), dtype),
        dw: T.Tensor((B, Tn, H, K), dtype),
        du: T.Tensor((B, Tn, H, V), dtype),
        chunk_start: T.Tensor((NS,), "int32"),
        chunk_len: T.Tensor((NS,), "int32"),
        dA_ab: T.Tensor((B, Tn, H, C), _ACC),
        dA_ak: T.Tensor((B, Tn, H, C), _ACC),
        dag: T.Tensor((B, Tn, H, K), dtype),
        dv: T.Tensor((B, Tn, H, V), dtype),
    ):
        # (slot, head) on grid x, head fastest; x has no 65535 limit (slots reach it at C = 16)
        with T.Kernel(NS * H, B, threads=threads) as (i_sh, i_b):
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            i_h = i_sh % H
            i_s = i_sh // H
            t0 = chunk_start[i_s]
            L = chunk_len[i_s]

            # fp32 C x C matrices as bf16 hi/lo pairs
            Ih = T.alloc_shared((C, C), _SPLIT)  # Inv
            Il = T.alloc_shared((C, C), _SPLIT)
            Akh = T.alloc_shared((C, C), _SPLIT)  # strict_lower(A_ak)
            Akl = T.alloc_shared((C, C), _SPLIT)
            Z1h = T.alloc_shared((C, C), _SPLIT)  # dw ag^T
            Z1l = T.alloc_shared((C, C), _SPLIT)
            Z2h = T.alloc_shared((C, C), _SPLIT)  # du v^T
            Z2l = T.alloc_shared((C, C), _SPLIT)
            Ph = T.alloc_shared((C, C), _SPLIT)  # Inv^T Z2
            Pl = T.alloc_shared((C, C), _SPLIT)
            Xh = T.alloc_shared((C, C), _SPLIT)  # Inv^T dA_inv
            Xl = T.alloc_shared((C, C), _SPLIT)
            # fp32 factors of the products with the data, as data-dtype hi/lo pairs
            Qh = T.alloc_shared((C, C), dtype)  # Q = Inv Ak
            Ql = T.alloc_shared((C, C), dtype)
            if share_inv:
                Idh, Idl = Ih, Il
            else:
                Idh = T.alloc_shared((C, C), dtype)
                Idl = T.alloc_shared((C, C), dtype)
            ag_s = T.alloc_shared((C, K), dtype)
            dw_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)
            du_s = T.alloc_shared((C, V), dtype)
            DG_f = T.alloc_fragment((C, K), _ACC)
            DV_f = T.alloc_fragment((C, V), _ACC)
            Z_f = T.alloc_fragment((C, C), _ACC)  # Z1, then Z2
            Q_f = T.alloc_fragment((C, C), _ACC)  # Q, then P
            X_f = T.alloc_fragment((C, C), _ACC)  # X, then dA_ab

            if L > 0:  # unused slot: nothing to read or write
                # ---- dag = Inv^T dw;  X = Inv^T (dw ag^T) ----
                load_inv(A_inv, i_b, i_h, t0, L, Ih, Il, Idh, Idl)
                load_rows(dw, i_b, i_h, t0, L, dw_s)
                load_rows(ag, i_b, i_h, t0, L, ag_s)
                T.clear(DG_f)
                T.clear(Z_f)
                gemm2(Idh, Idl, dw_s, DG_f, tA=True)
                gemm1(dw_s, ag_s, Z_f, tB=True)
                join()
                store_rows(DG_f, dag, i_b, i_h, t0, L)
                split(Z_f, Z1h, Z1l)
                T.clear(X_f)
                gemm3(Ih, Il, Z1h, Z1l, X_f, tA=True)
                join()

                # ---- Q = Inv Ak;  dv = Q^T du ----
                load_ak(A_ak, i_b, i_h, t0, L, Akh, Akl)
                T.clear(Q_f)
                gemm3(Ih, Il, Akh, Akl, Q_f)
                join()
                split(Q_f, Qh, Ql)
                load_rows(du, i_b, i_h, t0, L, du_s)
                T.clear(DV_f)
                gemm2(Qh, Ql, du_s, DV_f, tA=True)
                join()
                store_rows(DV_f, dv, i_b, i_h, t0, L)

                # ---- P = Inv^T (du v^T) -> dA_ak;  X += P Ak^T;  dA_ab = X Inv^T ----
                load_rows(v, i_b, i_h, t0, L, v_s)
                T.clear(Z_f)
                gemm1(du_s, v_s, Z_f, tB=True)
                join()
                split(Z_f, Z2h, Z2l)
                T.clear(Q_f)
                gemm3(Ih, Il, Z2h, Z2l, Q_f, tA=True)
                join()
                store_strict_lower(Q_f, dA_ak, i_b, i_h, t0, L)
                split(Q_f, Ph, Pl)
                gemm3(Ph, Pl, Akh, Akl, X_f, tB=True)
                join()
                split(X_f, Xh, Xl)
                T.clear(X_f)
                gemm3(Xh, Xl, Ih, Il, X_f, tB=True)
                join()
                store_strict_lower(X_f, dA_ab, i_b, i_h, t0, L)

    return wy_bwd


def variants():
    """Every (C, K, V, dtype) config the dispatch builds (K == V) and the compile test runs."""
    for C, K, dt in itertools.product(CHUNK_SIZES, HEAD_DIMS, DTYPES):
        yield dict(C=C, K=K, V=K, dtype=dt)


def ref_program(A_ab_inv, A_ak, ag, v, dw, du, cu_seqlens, chunk_size):
    """The contract: ``chunk_wy_bwd_reference`` (plain PyTorch, fp32 math); returns
    (dA_ab, dA_ak, dag, dv). ``cu_seqlens`` empty for rect inputs."""
    from torch_dplr.ops.wy import chunk_wy_bwd_reference

    return chunk_wy_bwd_reference(A_ab_inv, A_ak, ag, v, dw, du, cu_seqlens, chunk_size)
