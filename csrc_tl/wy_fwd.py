"""WY stage forward: A_ab_inv = (I - A_ab)^-1, w = A_ab_inv ag, u = A_ab_inv A_ak v.

Contract: :func:`torch_dplr.ops.wy.chunk_wy_fwd_reference` (math in
``torch_dplr/reference/wy.py``); only the strictly lower parts of A_ab and A_ak are read.

Grid: one CTA per (chunk slot, head) on grid x, head fastest (neighbouring CTAs read
neighbouring bytes of a token row), times B on grid y. Slot s covers rows
chunk_start[s] .. chunk_start[s] + chunk_len[s] - 1 (the tables of
:func:`torch_dplr.ops.varlen.kernel_tables`: a rect batch is passed as the sequence list of
its flattened [1, B*T] view, so rect and varlen are one kernel). Rows past chunk_len are
zero in every operand: they are never read (they belong to the next sequence or lie past
T) and never written; a slot with chunk_len 0 does nothing. Everything happens in shared
memory and registers; inputs are read once and outputs written once.

Triangular inverse, on tensor cores except for 16x16 diagonal blocks
--------------------------------------------------------------------
Write N = A_ab (strictly lower, C x C) as N = Nd + L, with Nd its 16x16
diagonal blocks and L the blocks strictly below them. With D = (I - Nd)^-1
(block diagonal):

    I - N = D^-1 (I - D L)   =>   (I - N)^-1 = (I - M)^-1 D,   M = D L.

M is strictly block-lower with C/16 block rows, so M^(C/16) = 0 and
(I - M)^-1 = I + M + ... is a finite product of doubling factors:

    C = 16:  Inv = D
    C = 32:  Inv = (I + M) D                = D + M D
    C = 64:  Inv = (I + M^2)(I + M) D       = P + M^2 P,  P = D + M D

(M and M^2 commute, so the order of the two factors is free; this order
makes the GEMM chain 3 deep: M -> {M^2, P} -> Inv.)

D itself is computed by forward substitution on CUDA cores, one thread per
column of D: thread c keeps its column of the 16x16 block in registers and
reads the rows of N it needs from shared memory. The recurrence is serial
per lane, so there is no cross-thread reduction (which raced in an earlier
TileLang port) and no barrier inside it; 16*nb threads, ~120 FMAs each.

fp32 products on bf16 tensor cores
----------------------------------
fp32 x fp32 products (the inverse, A_ab_inv A_ak) use a 3-term bf16 split,
x = hi + lo with hi = bf16(x), lo = bf16(x - hi):

    X Y ~= Xhi Yhi + Xhi Ylo + Xlo Yhi      (relative error ~2^-16)

bf16/fp16 wgmma accepts either operand major-ness, unlike tf32 wgmma (which
TileLang only uses for K-major B), and is ~2^5 more accurate than one tf32
pass. The final products with the data (ag, v) split only the fp32 factor
into two terms of the data dtype, so w and u carry fp32-accurate sums
rounded once to the output dtype. fp32 data splits both sides (3 terms).

Memory: A_ab is read once: its diagonal blocks as fp32 (for D), the rest
into its bf16 split (C <= 32: via one masked, vectorized fp32 staging copy).
A_ak goes straight into its split. TileLang reuses shared memory by liveness;
at C = 64 the data (A_ak, ag, v) is loaded after the inverse so a CTA needs
64 KB (bf16, K = V = 128) and 3 fit per SM. No TMA: with symbolic shapes
its descriptors would be encoded on the host at every launch.
Registers (ptxas, sm_90a, bf16 / fp16 alike, no spills): C = 16: 75;
C = 32: 85 (K = 64), 138 (K = 128); C = 64: 117 (under the 168 cap).

Signature (call ``kernel(*inputs, *outputs)``, nothing returned)::

    wy_fwd(A_ab, A_ak, ag, v, chunk_start, chunk_len, A_ab_inv, w, u)

A_ab, A_ak, A_ab_inv [B, T, H, C] fp32 (row = token, column = position in its chunk);
ag, w [B, T, H, K]; v, u [B, T, H, V] dtype; chunk_start, chunk_len int32 [S]. B (1 at
call time), T, H and S are symbolic: no recompile for a new size or sequence list.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals (B, Tn, H, NS, K, dtype, ...) at definition time.
import itertools

import tilelang.language as T

from .compile import canonical_dtype

__all__ = ["wy_fwd_kernel", "ref_program", "CHUNK_SIZES", "HEAD_DIMS", "DTYPES", "variants"]

#: Sizes the kernel is built and tested for.
CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16", "float32")

_SUB = 16  # diagonal block size (one mma tile)
_ACC = "float32"
_SPLIT = "bfloat16"  # dtype of the hi/lo terms of fp32 x fp32 products


# Default schedule per chunk size: (threads, stage_ab, late_data, min_blocks).
# C = 64: one warpgroup so the C x C GEMMs are wgmma (M = 64); data loaded
# after the inverse so 64 KB of smem and a 168-register cap give 3 CTAs/SM.
# C <= 32: mma.sync; 2 warps, A_ab staged by one (masked, vectorized) copy.
# Measured on the H200 (B=1, T=32768, H=32, K=V=128, bf16), see the report.
_SCHEDULES = {16: (64, True, False, 0), 32: (64, True, False, 0), 64: (128, False, True, 3)}


def wy_fwd_kernel(
    C: int,
    K: int,
    V: int,
    dtype: str,
    threads: int | None = None,
    stage_ab: bool | None = None,
    late_data: bool | None = None,
    min_blocks: int | None = None,
):
    """prim_func ``wy_fwd(A_ab, A_ak, ag, v, chunk_start, chunk_len, A_ab_inv, w, u)``.

    C: chunk size (16, 32, 64); K, V: head dims (multiples of 16, <= 256);
    dtype: dtype of ag / v / w / u.
    Schedule knobs (None: the per-C default in _SCHEDULES; results do not
    depend on them): threads; stage_ab copies the A_ab tile to fp32 shared
    memory first (vector loads, 4 B/elem more smem) instead of loading it
    element-wise into its two destinations; late_data loads A_ak / ag / v
    after the inverse (less smem, exposed latency); min_blocks > 0 asks nvcc
    to fit that many CTAs per SM (caps registers).
    """
    dtype = canonical_dtype(dtype)
    if C not in CHUNK_SIZES:
        raise ValueError(f"chunk size C={C} not in {CHUNK_SIZES}")
    for name, d in (("K", K), ("V", V)):
        if d % 16 or not 16 <= d <= 256:
            raise ValueError(f"{name}={d}: need a multiple of 16 in [16, 256]")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    d_threads, d_stage, d_late, d_min = _SCHEDULES[C]
    threads = d_threads if threads is None else threads
    stage_ab = d_stage if stage_ab is None else stage_ab
    late_data = d_late if late_data is None else late_data
    min_blocks = d_min if min_blocks is None else min_blocks
    if threads < C:
        raise ValueError(f"threads={threads} < C={C}: one thread per column of D")
    if C < 64 and threads // 32 > (C // 16) * (C // 8):
        # mma.sync tiles are m16n8: a C x C GEMM gives each warp at least one
        raise ValueError(f"threads={threads}: C={C} x {C} GEMMs cannot be split over {threads // 32} warps")

    nb = C // _SUB
    S = _SUB
    # dtype of the hi/lo terms in the products with the data
    ddt = _SPLIT if dtype == "float32" else dtype
    data_split = dtype == "float32"  # data itself needs a hi/lo split
    share_inv = ddt == _SPLIT  # one hi/lo pair of Inv serves both uses

    B, Tn, H, NS = T.dynamic("B, T, H, NS")

    @T.macro
    def split(src, hi, lo):
        # hi + lo == src to ~2^-17 relative; src fp32 (shared or fragment)
        for i, j in T.Parallel(*src.shape):
            hi[i, j] = T.Cast(hi.dtype, src[i, j])
            lo[i, j] = T.Cast(lo.dtype, src[i, j] - T.Cast(_ACC, T.Cast(hi.dtype, src[i, j])))

    @T.macro
    def gemm3(Xh, Xl, Yh, Yl, acc):
        # acc += X Y with both factors split; small terms first
        T.gemm(Xl, Yh, acc)
        T.gemm(Xh, Yl, acc)
        T.gemm(Xh, Yh, acc)

    @T.macro
    def load_rows(src, i_b, i_h, t0, L, dst):
        # dst = the chunk's rows of src, zero past the slot's L rows (never read there)
        for i, j in T.Parallel(*dst.shape):
            dst[i, j] = T.if_then_else(i < L, src[i_b, t0 + i, i_h, j], T.Cast(dst.dtype, 0))

    @T.macro
    def load_rows_split(src, i_b, i_h, t0, L, hi, lo):
        # fp32 data: its rows as a hi/lo split, zero past L
        for i, j in T.Parallel(*hi.shape):
            x = T.if_then_else(i < L, src[i_b, t0 + i, i_h, j], T.float32(0))
            hi[i, j] = T.Cast(_SPLIT, x)
            lo[i, j] = T.Cast(_SPLIT, x - T.Cast(_ACC, T.Cast(_SPLIT, x)))

    @T.macro
    def store_rows(src, dst, i_b, i_h, t0, L):
        # the slot's L rows of a fragment -> global; nothing past L
        for i, j in T.Parallel(*src.shape):
            if i < L:
                dst[i_b, t0 + i, i_h, j] = T.Cast(dst.dtype, src[i, j])

    @T.macro
    def load_data(A_ak, ag, v, i_b, i_h, t0, L, Akh, Akl, dst_g, dst_v):
        # A_ak (masked strictly lower) split; ag, v (split when fp32)
        for i, j in T.Parallel(C, C):
            a = T.if_then_else((i > j) and (i < L), A_ak[i_b, t0 + i, i_h, j], T.float32(0))
            Akh[i, j] = T.Cast(_SPLIT, a)
            Akl[i, j] = T.Cast(_SPLIT, a - T.Cast(_ACC, T.Cast(_SPLIT, a)))
        if data_split:
            load_rows_split(ag, i_b, i_h, t0, L, dst_g[0], dst_g[1])
            load_rows_split(v, i_b, i_h, t0, L, dst_v[0], dst_v[1])
        else:
            load_rows(ag, i_b, i_h, t0, L, dst_g)
            load_rows(v, i_b, i_h, t0, L, dst_v)

    @T.prim_func
    def wy_fwd(
        A_ab: T.Tensor((B, Tn, H, C), _ACC),
        A_ak: T.Tensor((B, Tn, H, C), _ACC),
        ag: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, H, V), dtype),
        chunk_start: T.Tensor((NS,), "int32"),
        chunk_len: T.Tensor((NS,), "int32"),
        A_inv: T.Tensor((B, Tn, H, C), _ACC),
        w: T.Tensor((B, Tn, H, K), dtype),
        u: T.Tensor((B, Tn, H, V), dtype),
    ):
        # (slot, head) on grid x, head fastest; x has no 65535 limit (slots reach it at C = 16)
        with T.Kernel(NS * H, B, threads=threads) as (i_sh, i_b):
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            i_h = i_sh % H
            i_s = i_sh // H
            t0 = chunk_start[i_s]
            L = chunk_len[i_s]

            Nd_s = T.alloc_shared((C, S), _ACC)  # diagonal blocks of A_ab
            D_s = T.alloc_shared((C, C), _ACC)  # block-diagonal inverse D
            Ih = T.alloc_shared((C, C), _SPLIT)  # the inverse, split
            Il = T.alloc_shared((C, C), _SPLIT)
            Akh = T.alloc_shared((C, C), _SPLIT)  # A_ak (strictly lower), split
            Akl = T.alloc_shared((C, C), _SPLIT)
            Qh = T.alloc_shared((C, C), ddt)  # Q = Inv A_ak, split for u = Q v
            Ql = T.alloc_shared((C, C), ddt)
            P_f = T.alloc_fragment((C, C), _ACC)  # ends as the inverse
            Q_f = T.alloc_fragment((C, C), _ACC)
            W_f = T.alloc_fragment((C, K), _ACC)
            U_f = T.alloc_fragment((C, V), _ACC)
            x = T.alloc_local((S,), _ACC)
            if data_split:
                agh = T.alloc_shared((C, K), _SPLIT)
                agl = T.alloc_shared((C, K), _SPLIT)
                vh = T.alloc_shared((C, V), _SPLIT)
                vl = T.alloc_shared((C, V), _SPLIT)
            else:
                ag_s = T.alloc_shared((C, K), dtype)
                v_s = T.alloc_shared((C, V), dtype)
            if nb > 1:
                Dh = T.alloc_shared((C, C), _SPLIT)
                Dl = T.alloc_shared((C, C), _SPLIT)
                Lh = T.alloc_shared((C, C), _SPLIT)  # A_ab below the diagonal blocks
                Ll = T.alloc_shared((C, C), _SPLIT)
                Mh = T.alloc_shared((C, C), _SPLIT)
                Ml = T.alloc_shared((C, C), _SPLIT)
                M_f = T.alloc_fragment((C, C), _ACC)
            if nb > 2:
                M2h = T.alloc_shared((C, C), _SPLIT)
                M2l = T.alloc_shared((C, C), _SPLIT)
                Ph = T.alloc_shared((C, C), _SPLIT)
                Pl = T.alloc_shared((C, C), _SPLIT)
                M2_f = T.alloc_fragment((C, C), _ACC)
            if stage_ab:
                N_s = T.alloc_shared((C, C), _ACC)
            if not share_inv:
                Iwh = T.alloc_shared((C, C), ddt)
                Iwl = T.alloc_shared((C, C), ddt)

            if L > 0:  # unused slot: nothing to read or write
                # ---- loads of A_ab: diagonal blocks (fp32) and the rest (split) ----
                if stage_ab:  # one vectorized copy of the tile, then split in smem
                    load_rows(A_ab, i_b, i_h, t0, L, N_s)
                    for i, j in T.Parallel(C, S):
                        Nd_s[i, j] = N_s[i, (i // S) * S + j]
                    if nb > 1:
                        for i, j in T.Parallel(C, C):
                            l = T.if_then_else(i // S > j // S, N_s[i, j], T.float32(0))
                            Lh[i, j] = T.Cast(_SPLIT, l)
                            Ll[i, j] = T.Cast(_SPLIT, l - T.Cast(_ACC, T.Cast(_SPLIT, l)))
                else:  # element loads straight into the fp32 diagonal / bf16 split
                    for i, j in T.Parallel(C, S):
                        Nd_s[i, j] = T.if_then_else(i < L, A_ab[i_b, t0 + i, i_h, (i // S) * S + j], T.float32(0))
                    if nb > 1:
                        for i, j in T.Parallel(C, C):
                            l = T.if_then_else((i // S > j // S) and (i < L), A_ab[i_b, t0 + i, i_h, j], T.float32(0))
                            Lh[i, j] = T.Cast(_SPLIT, l)
                            Ll[i, j] = T.Cast(_SPLIT, l - T.Cast(_ACC, T.Cast(_SPLIT, l)))
                if not late_data:
                    if data_split:
                        load_data(A_ak, ag, v, i_b, i_h, t0, L, Akh, Akl, (agh, agl), (vh, vl))
                    else:
                        load_data(A_ak, ag, v, i_b, i_h, t0, L, Akh, Akl, ag_s, v_s)

                # ---- D: 16x16 diagonal-block inverses, one column per thread ----
                tx = T.get_thread_binding()
                if tx < C:
                    r0 = (tx // S) * S  # first row / column of this thread's block
                    for r in T.unroll(S):
                        x[r] = T.if_then_else(r0 + r == tx, T.float32(1), T.float32(0))
                        for j in T.unroll(S):
                            if j < r:
                                x[r] = x[r] + Nd_s[r0 + r, j] * x[j]
                    for b in T.unroll(nb):
                        for r in T.unroll(S):
                            D_s[b * S + r, tx] = T.if_then_else(b * S == r0, x[r], T.float32(0))

                # ---- Inv = (I - M)^-1 D with M = D L, accumulated in P_f ----
                T.copy(D_s, P_f)
                if nb > 1:
                    split(D_s, Dh, Dl)
                    T.clear(M_f)
                    gemm3(Dh, Dl, Lh, Ll, M_f)  # M = D L
                    split(M_f, Mh, Ml)
                    gemm3(Mh, Ml, Dh, Dl, P_f)  # P = D + M D
                if nb > 2:
                    T.clear(M2_f)
                    gemm3(Mh, Ml, Mh, Ml, M2_f)  # M^2
                    split(M2_f, M2h, M2l)
                    split(P_f, Ph, Pl)
                    gemm3(M2h, M2l, Ph, Pl, P_f)  # Inv = P + M^2 P
                store_rows(P_f, A_inv, i_b, i_h, t0, L)
                split(P_f, Ih, Il)
                if late_data:
                    if data_split:
                        load_data(A_ak, ag, v, i_b, i_h, t0, L, Akh, Akl, (agh, agl), (vh, vl))
                    else:
                        load_data(A_ak, ag, v, i_b, i_h, t0, L, Akh, Akl, ag_s, v_s)

                # ---- Q = Inv A_ak, then w = Inv ag and u = Q v, one at a time ----
                T.clear(Q_f)
                gemm3(Ih, Il, Akh, Akl, Q_f)
                split(Q_f, Qh, Ql)
                T.clear(W_f)
                if data_split:
                    gemm3(Ih, Il, agh, agl, W_f)
                elif share_inv:
                    T.gemm(Il, ag_s, W_f)
                    T.gemm(Ih, ag_s, W_f)
                else:
                    split(P_f, Iwh, Iwl)
                    T.gemm(Iwl, ag_s, W_f)
                    T.gemm(Iwh, ag_s, W_f)
                store_rows(W_f, w, i_b, i_h, t0, L)
                T.clear(U_f)
                if data_split:
                    gemm3(Qh, Ql, vh, vl, U_f)
                else:
                    T.gemm(Ql, v_s, U_f)
                    T.gemm(Qh, v_s, U_f)
                store_rows(U_f, u, i_b, i_h, t0, L)

    return wy_fwd


def variants():
    """Every (C, K, V, dtype) config the dispatch builds (K == V, bf16 / fp16) and the compile
    test runs. fp32 data (in DTYPES) is supported by the factory but never dispatched."""
    for C, K, dt in itertools.product(CHUNK_SIZES, HEAD_DIMS, ("bfloat16", "float16")):
        yield dict(C=C, K=K, V=K, dtype=dt)


def ref_program(A_ab, A_ak, ag, v, cu_seqlens, chunk_size):
    """The contract: ``chunk_wy_fwd_reference`` (plain PyTorch, fp32 math); returns
    (A_ab_inv, w, u). ``cu_seqlens`` empty for rect inputs."""
    from torch_dplr.ops.wy import chunk_wy_fwd_reference

    return chunk_wy_fwd_reference(A_ab, A_ak, ag, v, cu_seqlens, chunk_size)
