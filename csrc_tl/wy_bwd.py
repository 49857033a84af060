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
C x C x C, against 7 and 2 for the literal order, and no C x K intermediate at all (the
C x C pairs live in shared memory one after the other). With the splits below: 6 + 15
tensor-core GEMMs per chunk.

Grid: one CTA per (chunk slot, head) on grid x, head fastest (neighbouring CTAs read
neighbouring bytes of a token row), times B on grid y. Slot s covers rows
chunk_start[s] .. chunk_start[s] + chunk_len[s] - 1 (the tables of
:func:`torch_dplr.ops.varlen.kernel_tables`; a rect batch is passed as the sequence list of
its flattened [1, B*T] view). Rows past chunk_len are zero in every operand and never
written; a slot with chunk_len 0 (or, which valid tables never give, one reaching past T)
does nothing. Each input row is read once and each output row written once; no atomics, no
TMA (its descriptors would be encoded on the host at every launch with symbolic shapes).

Loading: every input tile in flight at once
-------------------------------------------
A CTA first issues all six of its input tiles (Inv, Ak: C x C fp32; dw, ag: C x K; du, v:
C x V) as cp.async copies into shared memory, 16 bytes per thread and copy, one commit group
per tile, rows past T zero-filled by the copy. Nothing is masked at load time (a per-element
mask made the old loads scalar, and each load phase waited a full memory latency behind the
previous phase's barriers): the chunk's C rows are copied whole, and rows >= chunk_len, which
hold the next sequence's tokens, are dealt with when shared memory is read -- zeroed in the
data tiles in one vectorized pass (only in a partial chunk), and selected away while Inv and
Ak are converted to their hi/lo pairs (Ak's strict-lower mask is applied in registers, so that
conversion stays vectorized too). With ``late_du_v`` (default only where the shared memory
would otherwise drop below 2 CTAs per SM: fp16 at C = 64, K = V = 128) du and v are issued
once dw and ag are consumed, into their place. Outputs are stored straight from the
accumulator fragments, rows < chunk_len only (8-byte fp32 / 4-byte 16-bit vector stores, one
predicate per row). The CTA's head and slot are computed once (as variables; an index
expression was re-derived as a 64-bit remainder at every global access) and the slot is
checked to lie inside T, which lets TileLang drop the per-access bounds checks of the stores.

Per CTA, in this order (GEMMs of one step issued back to back, one wait)::

    issue all loads; wait for Inv, Ak, dw, ag     Ak -> Akh/Akl,  Inv -> Ih/Il
    dag = Inv^T dw -> out,  Z1 = dw ag^T          (du, v issued here under late_du_v)
    X = Inv^T Z1,  Q = Inv Ak;  wait for du, v
    dv = Q^T du -> out;  then Z2 = du v^T         (one after the other: fewer live registers)
    P = Inv^T Z2
    X += P Ak^T  (dA_ak = strict_lower(P) stored meanwhile);  X Inv^T -> dA_ab

Between a wgmma's issue and its wait nothing is written to shared memory and no barrier is
placed: TileLang overlaps shared buffers by liveness and places barriers as if a GEMM read its
operands when issued, so a barrier there would pass for the end of the reads.

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

Resources (sm_90a, nvcc 13, default schedules, ptxas; no spills)
----------------------------------------------------------------
Shared memory is the peak TileLang's liveness overlap lays out (the staged tiles plus Inv's
pairs, see :func:`_smem_peak`); CTAs per SM is the smaller of the register and the shared
memory bound (228 KB per SM, 1 KB reserved per CTA). "was": the previous version (phased,
masked loads; 1.9 GB moved in 2.27 ms at the design shape).

    C   K=V  dtype  threads  shared   registers   CTAs (warps) per SM   SASS instrs   was
    16   64  both      64   11-12 KB    56 (cap)   18 / 17 fp16 (36)     ~1000     56 regs, 18
    16  128  both      64   19-20 KB    72         11 / 10 fp16 (22)     ~2000     86 regs, 11
    32   64  both     128   28-32 KB    90 (cap)       5 (20)             ~1450     80 regs, 6
    32  128  both     128   44-48 KB   123             4 (16)             ~2350    117 regs, 4
    64   64  bf16     256      80 KB    90             2 (16)              2136     96 regs, 2, 7656
    64   64  fp16     256      96 KB    90             2 (16)              2176
    64  128  bf16     256     112 KB   106             2 (16)              3000    112 regs, 2, 9536
    64  128  fp16     256  96 KB late  106             2 (16)              2720

(cap: _MIN_BLOCKS, free of spills.) At C = 64 the registers (2 x 256 threads x 90-106) allow
2 CTAs, and shared memory is sized to keep that (112 KB x 2 + 2 KB reserve fits 228 KB, just);
3 CTAs would need <= 80 registers, and under that cap ptxas spills and serializes every wgmma.
The gain is in latency and issue: one memory round trip per CTA for its data instead of four
serialized ones, and ~3.5x fewer instructions (no scalar A_ak loads, no scalar fp32 stores, no 64-bit
remainder per global address).

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
from .tile_macros import zero_rows_from

__all__ = ["wy_bwd_kernel", "ref_program", "CHUNK_SIZES", "HEAD_DIMS", "DTYPES", "variants"]

#: Sizes the kernel is built and tested for.
CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")

_ACC = "float32"
_SPLIT = "bfloat16"  # dtype of the hi/lo terms of fp32 x fp32 products

# Default threads per chunk size. Not yet measured on the GPU.
# C = 64: two warpgroups, every GEMM a wgmma (M = 64, N split between the warpgroups):
# 90 / 106 registers (K = V = 64 / 128), so 2 CTAs (16 warps) per SM; a 3-CTA cap (80
# registers) makes ptxas spill and serialize every wgmma, and one warpgroup needs ~186
# registers (8 warps per SM). C <= 32: mma.sync; a 16 x 16 GEMM splits over at most 2
# warps (m16n8 tiles), a 32 x 32 one over 8.
_THREADS = {16: 64, 32: 128, 64: 256}

# Register caps (CTAs per SM) that cost no spills at the default threads, K = V = 64:
# C = 16: 68 -> 56 registers (14 -> 18 CTAs); C = 32: 98 -> 90 (4 -> 5 CTAs).
_MIN_BLOCKS = {(16, 64): 18, (32, 64): 5}

_SMEM_PER_SM = 228 * 1024  # sm_90a, of which 1 KB per CTA is reserved by the driver


def _smem_peak(C: int, K: int, V: int, dtype: str, late_du_v: bool) -> int:
    """Bytes of shared memory at the kernel's peak (the first conversion step), as TileLang's
    liveness overlap lays them out: the fp32 Inv and A_ak tiles, the data tiles in flight (dw,
    ag, and du, v unless late_du_v), and Inv's hi/lo pair (two pairs for fp16)."""
    e = 2  # bf16 / fp16
    data = e * C * (2 * K if late_du_v else 2 * (K + V))
    inv_pairs = 1 if canonical_dtype(dtype) == _SPLIT else 2
    return 2 * 4 * C * C + data + inv_pairs * 2 * 2 * C * C


def _default_late_du_v(C: int, K: int, V: int, dtype: str) -> bool:
    """Load du, v with everything else unless that alone would drop the CTAs per SM below 2
    (the register limit at C = 64): fp16 at K = V = 128 (128 KB early, 96 KB late)."""
    return 2 * (_smem_peak(C, K, V, dtype, False) + 1024) > _SMEM_PER_SM


def wy_bwd_kernel(C: int, K: int, V: int, dtype: str, threads: int | None = None,
                  min_blocks: int | None = None, late_du_v: bool | None = None):
    """prim_func ``wy_bwd(A_ab_inv, A_ak, ag, v, dw, du, chunk_start, chunk_len, dA_ab, dA_ak,
    dag, dv)`` for one config (see the module docstring).

    C: chunk size (16, 32, 64); K, V: head dims of ag / dw and v / du (multiples of 16,
    <= 256); dtype: the data dtype (bf16 / fp16). Schedule knobs (None: the defaults in
    _THREADS, _MIN_BLOCKS and _default_late_du_v; results do not depend on them): threads;
    min_blocks > 0 asks nvcc to fit that many CTAs per SM (caps registers); late_du_v issues
    the du and v loads once dw and ag are consumed (their shared memory reused: less shared
    memory, their latency exposed) instead of with all the others at the start.
    """
    dtype = canonical_dtype(dtype)
    if C not in CHUNK_SIZES:
        raise ValueError(f"chunk size C={C} not in {CHUNK_SIZES}")
    for name, d in (("K", K), ("V", V)):
        if d % 16 or not 16 <= d <= 256:
            raise ValueError(f"{name}={d}: need a multiple of 16 in [16, 256]")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if min_blocks is None:  # the caps hold for the default threads only
        min_blocks = _MIN_BLOCKS.get((C, max(K, V)), 0) if threads in (None, _THREADS[C]) else 0
    threads = _THREADS[C] if threads is None else threads
    late_du_v = _default_late_du_v(C, K, V, dtype) if late_du_v is None else late_du_v
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
        # wait for this warpgroup's issued wgmmas (mma.sync at C <= 32 is synchronous already).
        # TileLang overlaps shared buffers by liveness and places barriers as if a GEMM read
        # its operands when issued, so between an issue and its join: no shared-memory writes
        # and no barrier (a barrier there would pass for the end of the GEMM's reads).
        if use_wgmma:
            T.wait_wgmma(0)

    @T.macro
    def issue_rows(src, i_b, i_h, t0, dst):
        # cp.async of the chunk's C rows of src into dst: one commit group, 16-byte copies,
        # rows past T zero-filled. Nothing waits here; rows past the slot's L are masked by
        # the reader (zero_rows / the converters), after the wait.
        T.async_copy(src[i_b, t0 : t0 + C, i_h, :], dst)

    @T.macro
    def landed(pending):
        # this thread's copies but the last `pending` groups are done; the barrier makes
        # every thread's visible
        T.ptx_wait_group(pending)
        T.sync_threads()

    zero_rows = zero_rows_from(C)

    @T.macro
    def convert_inv(InvF, L, Ih, Il, Idh, Idl):
        # staged Inv rows (as given, zero past L) -> bf16 hi/lo (and data-dtype hi/lo for fp16)
        for i, j in T.Parallel(C, C):
            x = T.if_then_else(i < L, InvF[i, j], T.float32(0))
            Ih[i, j] = T.Cast(_SPLIT, x)
            Il[i, j] = T.Cast(_SPLIT, x - T.Cast(_ACC, T.Cast(_SPLIT, x)))
            if not share_inv:
                Idh[i, j] = T.Cast(dtype, x)
                Idl[i, j] = T.Cast(dtype, x - T.Cast(_ACC, T.Cast(dtype, x)))

    @T.macro
    def convert_ak(AkF, L, AkR, Akh, Akl):
        # staged A_ak -> strict_lower(A_ak), zero past L, as bf16 hi/lo. The element mask is
        # applied in registers (AkR): in a shared-memory pass it would make every access scalar
        T.copy(AkF, AkR)
        for i, j in T.Parallel(C, C):
            AkR[i, j] = T.if_then_else((i > j) and (i < L), AkR[i, j], T.float32(0))
        split(AkR, Akh, Akl)

    @T.macro
    def keep_strict_lower(frag):
        # zero a C x C fragment on and above the diagonal (registers only)
        for i, j in T.Parallel(C, C):
            frag[i, j] = T.if_then_else(j < i, frag[i, j], T.float32(0))

    @T.macro
    def store_rows(src, dst, i_b, i_h, t0, L):
        # the slot's L rows of a fragment -> global (each thread's adjacent columns as one
        # vector store); nothing past L
        for i, j in T.Parallel(*src.shape):
            if i < L:
                dst[i_b, t0 + i, i_h, j] = T.Cast(dst.dtype, src[i, j])

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
            # head and slot as variables computed once: an expression would be re-derived (an
            # int64 remainder) at every one of the many global addresses below
            i_h = T.alloc_var("int32", init=i_sh % H)
            i_s = T.alloc_var("int32", init=i_sh // H)
            t0 = chunk_start[i_s]
            L = chunk_len[i_s]

            # staged inputs (cp.async targets); the fp32 ones die at their conversion
            InvF = T.alloc_shared((C, C), _ACC)
            AkF = T.alloc_shared((C, C), _ACC)
            ag_s = T.alloc_shared((C, K), dtype)
            dw_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)
            du_s = T.alloc_shared((C, V), dtype)
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
            DG_f = T.alloc_fragment((C, K), _ACC)
            DV_f = T.alloc_fragment((C, V), _ACC)
            Z_f = T.alloc_fragment((C, C), _ACC)  # Z1, then Z2
            Q_f = T.alloc_fragment((C, C), _ACC)  # Q, then P
            X_f = T.alloc_fragment((C, C), _ACC)  # X, then dA_ab
            AkR = T.alloc_fragment((C, C), _ACC)  # A_ak on its way to Akh / Akl

            # L > 0: an unused slot has nothing to read or write. The rest always holds for
            # valid tables; stated here, it lets TileLang drop per-access bounds checks
            if L > 0 and 0 <= t0 and t0 + L <= Tn and 0 <= i_h and i_h < H:
                # ---- every load in flight at once (du, v later under late_du_v) ----
                issue_rows(A_inv, i_b, i_h, t0, InvF)
                issue_rows(A_ak, i_b, i_h, t0, AkF)
                issue_rows(dw, i_b, i_h, t0, dw_s)
                issue_rows(ag, i_b, i_h, t0, ag_s)
                if not late_du_v:
                    issue_rows(du, i_b, i_h, t0, du_s)
                    issue_rows(v, i_b, i_h, t0, v_s)

                # ---- Ak, Inv -> hi/lo pairs (Ak first: its pair may take AkF's place) ----
                landed(0 if late_du_v else 2)
                zero_rows(L, dw_s)
                zero_rows(L, ag_s)
                convert_ak(AkF, L, AkR, Akh, Akl)
                convert_inv(InvF, L, Ih, Il, Idh, Idl)
                T.sync_threads()

                # ---- dag = Inv^T dw;  Z1 = dw ag^T ----
                T.clear(DG_f)
                T.clear(Z_f)
                gemm2(Idh, Idl, dw_s, DG_f, tA=True)
                gemm1(dw_s, ag_s, Z_f, tB=True)
                join()
                if late_du_v:
                    # every warpgroup is done with dw, ag: du, v may take their place
                    T.sync_threads()
                    issue_rows(du, i_b, i_h, t0, du_s)
                    issue_rows(v, i_b, i_h, t0, v_s)
                store_rows(DG_f, dag, i_b, i_h, t0, L)
                split(Z_f, Z1h, Z1l)
                T.sync_threads()

                # ---- X = Inv^T Z1;  Q = Inv Ak ----
                T.clear(X_f)
                T.clear(Q_f)
                gemm3(Ih, Il, Z1h, Z1l, X_f, tA=True)
                gemm3(Ih, Il, Akh, Akl, Q_f)
                join()
                landed(0)  # du, v; the barrier also ends every warpgroup's reads of Z1, Ak
                zero_rows(L, du_s)
                zero_rows(L, v_s)
                split(Q_f, Qh, Ql)
                T.sync_threads()

                # ---- dv = Q^T du;  then Z2 = du v^T (one after the other: fewer live registers)
                T.clear(DV_f)
                gemm2(Qh, Ql, du_s, DV_f, tA=True)
                join()
                store_rows(DV_f, dv, i_b, i_h, t0, L)
                T.clear(Z_f)
                gemm1(du_s, v_s, Z_f, tB=True)
                join()
                split(Z_f, Z2h, Z2l)
                T.sync_threads()

                # ---- P = Inv^T Z2 -> dA_ak ----
                T.clear(Q_f)
                gemm3(Ih, Il, Z2h, Z2l, Q_f, tA=True)
                join()
                split(Q_f, Ph, Pl)
                T.sync_threads()

                # ---- X += P Ak^T;  dA_ab = X Inv^T ----
                gemm3(Ph, Pl, Akh, Akl, X_f, tB=True)
                keep_strict_lower(Q_f)  # registers only, under the GEMMs
                store_rows(Q_f, dA_ak, i_b, i_h, t0, L)
                join()
                split(X_f, Xh, Xl)
                T.sync_threads()
                T.clear(X_f)
                gemm3(Xh, Xl, Ih, Il, X_f, tB=True)
                join()
                keep_strict_lower(X_f)
                store_rows(X_f, dA_ab, i_b, i_h, t0, L)

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
