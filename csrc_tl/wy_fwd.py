"""WY stage forward: A_ab_inv = (I - A_ab)^-1, w = A_ab_inv ag, u = A_ab_inv A_ak v.

Contract: :func:`torch_dplr.ops.wy.chunk_wy_fwd_reference` (math in
``torch_dplr/reference/wy.py``); only the strictly lower parts of A_ab and A_ak are read.

Grid: one CTA per (chunk slot, head) on grid x, head fastest (neighbouring CTAs read
neighbouring bytes of a token row), times B on grid y. Slot s covers rows
chunk_start[s] .. chunk_start[s] + chunk_len[s] - 1 (the tables of
:func:`torch_dplr.ops.varlen.kernel_tables`: a rect batch is passed as the sequence list of
its flattened [1, B*T] view, so rect and varlen are one kernel). Rows past chunk_len are
zero in every operand: the bulk copies bring them in (they belong to the next sequence, or
lie past T and arrive as zeros), but they are masked wherever the staged copies are read
(ag, v: zeroed in place) and never written; a slot with chunk_len 0 does nothing.
Everything happens in shared memory and registers; inputs are read once and outputs
written once.

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

Loads, overlap, occupancy
-------------------------
Every global load of a CTA is issued before any math, as cp.async bulk copies of the
chunk's rows (16 bytes per thread and instruction, one commit group per tensor, no
branches): A_ab and A_ak (fp32, C x C), ag and v. The kernel waits for A_ab alone, builds
the inverse while the rest is in flight, and waits for the others before the products with
the data. Masks (rows >= chunk_len; the upper triangles, which may hold anything) are
applied when the staged tiles are read, never at load time. The head index is computed
once into a register (inlined, ``i_sh % H`` was a 64-bit remainder behind a branch at
every global access). Why: the previous version loaded element-wise inside the parallel
passes; A_ak came as 32 scalar 4-byte loads per thread, each behind such a branch and
between shared-memory stores, after the whole inverse, so each waited a full memory
latency (2.15 ms, 14% of HBM bandwidth at the design shape).

At C = 64 (one warpgroup) the wgmma GEMMs are issued without waiting: the terms of a
split product back to back, P = D + M D together with M^2, Q = Inv A_ak together with
w = Inv ag; one wait per phase. w and u go through swizzled shared memory (stmatrix) and
out as 16-byte row stores (w while u = Q v runs); A_ab_inv goes out from the accumulator
fragment (8-byte stores, whole 32-byte sectors).

``late_data`` issues the copies of ag and v only after the inverse (into memory it freed),
so they land while Q = Inv A_ak is computed: less shared memory, more CTAs per SM, their
latency partly exposed. Not the default; worth measuring at K = 128.

TileLang reuses shared memory by liveness (the staged copies are live from their issue).
Per CTA (bf16; ptxas sm_90a, no spills) and CTAs per SM on the H200 (228 KB of shared
memory, 64K registers, 1 KB reserved per CTA):

    C   K    threads  shared    registers  CTAs/SM   (late_data: shared, regs, CTAs)
    64  64   128      72 KB     114        3         56 KB, 114, 4
    64  128  128      88 KB     138        2         64 KB, 115, 3
    32  64   64       22 KB     100        9
    32  128  64       30 KB     130        7
    16  64   64       7 KB      48         21
    16  128  64       11 KB     66         14

(the previous version, C = 64: 52 KB / 117 registers / 4 CTAs at K = 64, 64 KB / 3 at
K = 128). No TMA: with symbolic shapes its descriptors would be encoded on the host at
every launch.

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
from tilelang.layout import make_swizzled_layout

from .compile import canonical_dtype
from .tile_macros import split, split_gemms, split_of, wgmma_join, zero_rows_from

__all__ = ["wy_fwd_kernel", "ref_program", "CHUNK_SIZES", "HEAD_DIMS", "DTYPES", "variants"]

#: Sizes the kernel is built and tested for.
CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16", "float32")

_SUB = 16  # diagonal block size (one mma tile)
_ACC = "float32"
_SPLIT = "bfloat16"  # dtype of the hi/lo terms of fp32 x fp32 products


# Default schedule per chunk size: (threads, late_data, min_blocks).
# C = 64: one warpgroup, so the C x C GEMMs are wgmma (M = 64), issued
# asynchronously; every input copy is issued at the start. C <= 32: mma.sync
# on 2 warps. min_blocks = 3 caps registers at 168 (3 CTAs of 128 threads).
# Not yet measured on the H200 (see the module docstring for the occupancy).
_SCHEDULES = {16: (64, False, 0), 32: (64, False, 0), 64: (128, False, 3)}

_NOWAIT = {"wg_wait": -1}  # issue a wgmma without waiting; T.wait_wgmma(0) joins


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
    depend on them): threads; late_data issues the copies of ag / v after
    the inverse instead of at the start (less shared memory, latency partly
    exposed; see the module docstring); min_blocks > 0 asks nvcc to fit that
    many CTAs per SM (caps registers). stage_ab is accepted for older callers
    and has no effect: A_ab is always staged by one cp.async copy.
    """
    del stage_ab  # always staged now (see the docstring)
    dtype = canonical_dtype(dtype)
    if C not in CHUNK_SIZES:
        raise ValueError(f"chunk size C={C} not in {CHUNK_SIZES}")
    for name, d in (("K", K), ("V", V)):
        if d % 16 or not 16 <= d <= 256:
            raise ValueError(f"{name}={d}: need a multiple of 16 in [16, 256]")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    d_threads, d_late, d_min = _SCHEDULES[C]
    threads = d_threads if threads is None else threads
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
    # wgmma (one warpgroup per 64 rows) can be issued without waiting; mma.sync cannot
    wgmma = C % 64 == 0 and threads % 128 == 0
    nowait = _NOWAIT if wgmma else None

    B, Tn, H, NS = T.dynamic("B, T, H, NS")

    join = wgmma_join(threads, wgmma)
    gemm3, gemm2 = split_gemms(nowait)  # the caller joins

    def masked(src, keep):
        # src[i, j] where keep(i, j), else 0: masks are applied on the staged copy
        return lambda i, j: T.if_then_else(keep(i, j), src[i, j], T.float32(0))

    @T.macro
    def copy_rows(src, i_b, i_h, t0, dst):
        # cp.async of the chunk's C rows (one commit group); rows past T arrive as zeros
        T.async_copy(src[i_b, t0 : t0 + C, i_h, :], dst)

    zero_rows = zero_rows_from(C)

    @T.macro
    def store_rows(src, dst, i_b, i_h, t0, L):
        # the slot's L rows -> global; nothing past L
        for i, j in T.Parallel(*src.shape):
            if i < L:
                dst[i_b, t0 + i, i_h, j] = T.Cast(dst.dtype, src[i, j])

    @T.macro
    def block_diagonal_inverses(Ab_s, L, x, Dd_s):
        # D = (I - Nd)^-1 by forward substitution, one thread per column of D:
        # Dd_s[r, c % 16] = D[r, c] for row r in c's 16-row block. Rows >= L of
        # Nd read as zero.
        tx = T.get_thread_binding()
        if tx < C:
            r0 = (tx // S) * S  # first row / column of this thread's block
            for r in T.unroll(S):
                x[r] = T.if_then_else(r0 + r == tx, T.float32(1), T.float32(0))
                for j in T.unroll(S):
                    if j < r:
                        x[r] = x[r] + T.if_then_else(r0 + r < L, Ab_s[r0 + r, r0 + j], T.float32(0)) * x[j]
            for r in T.unroll(S):
                Dd_s[r0 + r, tx % S] = x[r]

    @T.macro
    def product_q(Ih, Il, Akh, Akl, Q_f):
        T.clear(Q_f)
        gemm3(Ih, Il, Akh, Akl, Q_f)  # Q = Inv A_ak

    @T.macro
    def product_w(Ih, Il, Iwh, Iwl, ag_s, agh, agl, W_f):
        # W = Inv ag: both factors split (fp32 data), or Inv's pair for the data dtype
        T.clear(W_f)
        if data_split:
            gemm3(Ih, Il, agh, agl, W_f)
        elif share_inv:
            gemm2(Ih, Il, ag_s, W_f)
        else:
            gemm2(Iwh, Iwl, ag_s, W_f)

    @T.macro
    def prepare_data(L, ag_s, v_s, agh, agl, vh, vl):
        # rows >= L of ag, v read as zero: split (fp32 data) or zeroed in place
        if data_split:
            split_of(masked(ag_s, lambda i, j: i < L), agh, agl)
            split_of(masked(v_s, lambda i, j: i < L), vh, vl)
        else:
            zero_rows(L, ag_s)
            zero_rows(L, v_s)

    def d_entry(Dd_s):
        # D[i, j] from its compact form (zero off the diagonal blocks)
        return lambda i, j: T.if_then_else(i // S == j // S, Dd_s[i, j % S], T.float32(0))

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
            # a register, computed once: inlined, `% H` became a 64-bit remainder per access
            i_h = T.alloc_var("int32", init=i_sh % H)
            i_s = i_sh // H
            t0 = chunk_start[i_s]
            L = chunk_len[i_s]

            # staged inputs (cp.async); masks are applied where they are read
            Ab_s = T.alloc_shared((C, C), _ACC)
            Ak_s = T.alloc_shared((C, C), _ACC)
            ag_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)
            Dd_s = T.alloc_shared((C, S), _ACC)  # block-diagonal inverse D, compact
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
            # w, u staged in shared memory (swizzled: conflict-free fragment writes) for 16-byte stores
            Wo_s = T.alloc_shared((C, K), dtype)
            Uo_s = T.alloc_shared((C, V), dtype)
            T.annotate_layout({Wo_s: make_swizzled_layout(Wo_s), Uo_s: make_swizzled_layout(Uo_s)})
            agh = agl = vh = vl = Iwh = Iwl = None  # allocated below where used
            if data_split:
                agh = T.alloc_shared((C, K), _SPLIT)
                agl = T.alloc_shared((C, K), _SPLIT)
                vh = T.alloc_shared((C, V), _SPLIT)
                vl = T.alloc_shared((C, V), _SPLIT)
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
            if not share_inv:
                Iwh = T.alloc_shared((C, C), ddt)
                Iwl = T.alloc_shared((C, C), ddt)

            if L > 0:  # unused slot: nothing to read or write
                # ---- the CTA's loads in flight at once: one cp.async group per tensor ----
                copy_rows(A_ab, i_b, i_h, t0, Ab_s)
                copy_rows(A_ak, i_b, i_h, t0, Ak_s)
                if late_data:
                    T.ptx_wait_group(1)  # A_ab
                else:
                    copy_rows(ag, i_b, i_h, t0, ag_s)
                    copy_rows(v, i_b, i_h, t0, v_s)
                    T.ptx_wait_group(3)  # A_ab
                T.sync_threads()

                # ---- A_ab -> D (CUDA cores) and L = A_ab below the diagonal blocks, split ----
                if nb > 1:
                    split_of(masked(Ab_s, lambda i, j: (i // S > j // S) and (i < L)), Lh, Ll)
                block_diagonal_inverses(Ab_s, L, x, Dd_s)
                T.sync_threads()
                for i, j in T.Parallel(C, C):
                    P_f[i, j] = d_entry(Dd_s)(i, j)

                # ---- Inv = (I - M)^-1 D with M = D L, accumulated in P_f ----
                if nb > 1:
                    split_of(d_entry(Dd_s), Dh, Dl)
                    T.clear(M_f)
                    gemm3(Dh, Dl, Lh, Ll, M_f)  # M = D L
                    join(M_f)
                    split(M_f, Mh, Ml)
                    gemm3(Mh, Ml, Dh, Dl, P_f)  # P = D + M D
                    if nb > 2:
                        T.clear(M2_f)
                        gemm3(Mh, Ml, Mh, Ml, M2_f)  # M^2, in flight with P
                        join(P_f, M2_f)
                    else:
                        join(P_f)
                if nb > 2:
                    split(M2_f, M2h, M2l)
                    split(P_f, Ph, Pl)
                    gemm3(M2h, M2l, Ph, Pl, P_f)  # Inv = P + M^2 P
                    join(P_f)
                split(P_f, Ih, Il)
                store_rows(P_f, A_inv, i_b, i_h, t0, L)

                # ---- A_ak split: strictly lower, rows < L ----
                T.ptx_wait_group(0)  # late_data: A_ak; else everything
                T.sync_threads()
                split_of(masked(Ak_s, lambda i, j: (i > j) and (i < L)), Akh, Akl)
                if not share_inv:  # Inv as two terms of the data dtype (fp16), for w = Inv ag
                    split(P_f, Iwh, Iwl)

                # ---- Q = Inv A_ak, w = Inv ag ----
                if late_data:
                    # ag, v go out now, into memory the inverse freed, and land while Q is made
                    T.sync_threads()  # every thread is done with Ak_s (ag_s, v_s may reuse it)
                    copy_rows(ag, i_b, i_h, t0, ag_s)
                    copy_rows(v, i_b, i_h, t0, v_s)
                    product_q(Ih, Il, Akh, Akl, Q_f)
                    join(Q_f)
                    split(Q_f, Qh, Ql)
                    T.ptx_wait_group(0)
                    T.sync_threads()
                    prepare_data(L, ag_s, v_s, agh, agl, vh, vl)
                    product_w(Ih, Il, Iwh, Iwl, ag_s, agh, agl, W_f)
                    join(W_f)
                else:
                    prepare_data(L, ag_s, v_s, agh, agl, vh, vl)
                    product_q(Ih, Il, Akh, Akl, Q_f)
                    if not wgmma:  # Q_f done: split it now so Q_f and W_f are not live together
                        split(Q_f, Qh, Ql)
                    product_w(Ih, Il, Iwh, Iwl, ag_s, agh, agl, W_f)  # wgmma: in flight with Q
                    join(Q_f, W_f)
                    if wgmma:
                        split(Q_f, Qh, Ql)
                T.copy(W_f, Wo_s)

                # ---- u = Q v; w stored meanwhile ----
                T.clear(U_f)
                if data_split:
                    gemm3(Qh, Ql, vh, vl, U_f)
                else:
                    gemm2(Qh, Ql, v_s, U_f)
                store_rows(Wo_s, w, i_b, i_h, t0, L)
                join(U_f)
                T.copy(U_f, Uo_s)
                store_rows(Uo_s, u, i_b, i_h, t0, L)

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
