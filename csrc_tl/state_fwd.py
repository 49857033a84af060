"""State pass forward (``dplr::chunk_state_fwd``): o, final state, and optionally h and v_new.

Per chunk of C rows (h = fp32 state at the chunk's start, K x V):

    v_new = u + w h
    o     = qg h + A_qk v + A_qb v_new
    h'    = 2^gl * h + kg^T v + bg^T v_new        (2^gl scales row k of h; gl <= 0)

Grid and walk
-------------
One CTA (one warpgroup by default) per (V-block of BV columns, head,
sequence); V-blocks fastest so the CTAs that share a chunk's [C, K] tiles
(qg, kg, bg, w) run side by side and meet in L2. A CTA walks its sequence's
chunks serially with its K x BV slice of h in an fp32 accumulator fragment;
h and v_new are never written and read back to make o. One variant serves rect
and varlen: the kernel always sees a list of sequences (B == 1; a rect batch
arrives flattened as cu_seqlens = [0, T, 2T, ...], see torch_dplr/ops/varlen.py).
Sequence n spans cu_seqlens[n] .. cu_seqlens[n+1], its chunk c is slot
chunk_offsets[n] + c. Its last chunk's rows past the sequence end hold the
next sequence's tokens (or, past T, load as zero: cp.async zero-fill): v, kg
and bg are zeroed there in shared memory (kg^T v, bg^T v_new would see them,
and a non-finite row of the next sequence must not reach this one's state),
v_new rows there are zeroed in registers (A_qb v_new), and o / v_new stores are
predicated; the qg, w, u, A rows there only reach rows that are masked or never
stored (A_qk, A_qb are lower triangular).

Optional tensors are decided at run time from their symbolic sizes, by
branches uniform over the CTA: h0 with N0 == 0 means h starts at 0; h and
v_new with Sh == 0 mean the activations are not kept (nothing is written).

Per chunk (double buffer `cur`)::

    sync; cp.async chunk c+1 -> other buffer; wait for chunk c; sync
    h -> hh (+ hl) in shared; [h -> global if kept]; h *= 2^gl
    async wgmma: v_new = w hh (+ w hl); o = qg hh (+ qg hl) + A_qk v; h += kg^T v
    wait; v_new += u; v_new -> vh (+ vl); [v_new -> global if kept]; sync
    async wgmma: o += A_qb vh (+ A_qb vl); h += bg^T vh (+ bg^T vl)
    wait; o -> global

Pipelining
----------
Hand-rolled double buffer: the nine tiles of chunk c+1 (qg, kg, bg, w: C x K;
u, v: C x BV; A_qk, A_qb: C x C; gl: K) are fetched with cp.async (one commit
group each) into the second buffer while chunk c's GEMMs run; chunk c waits
with cp.async.wait_group(9). ``num_stages=1`` loads each chunk just before
use (no prefetch, half the tile memory). Not ``T.Pipelined``: in TileLang
0.1.15 (a) its warp-specialized form moved the h -> shared conversion into
the producer warps, which read a stale copy of h; (b) with a data-dependent
trip count (varlen) the pipeline epilogue failed to lower (non-constant
cp.async wait count); (c) the planner refuses the in-place varlen mask of v;
(d) its cp.async for chunk c+2 is issued right after the statement that last
reads a buffer, which races with an un-waited (async) wgmma still reading it.
The hand-rolled loop allows the GEMMs of a phase to be issued back to back
without a wait between them (TileLang's `wg_wait=-1`), one wait per phase.

GEMMs with the fp32 state (precision)
-------------------------------------
Tensor cores take the data dtype, but h and v_new are fp32. With
``split=True`` (default) each is written to shared memory as two terms of the
data dtype, x = hi + lo (hi = dtype(x), lo = dtype(x - hi)), and every product
with it is two GEMMs (w h, qg h, A_qb v_new, bg^T v_new): fp32-accurate to
~2^-16 relative. ``split=False`` rounds h and v_new to the data dtype once
(what flash-linear-attention does): 4 fewer GEMMs per chunk, but the rounding
feeds back through the recurrence. CPU emulation at T=4096, K=V=64, C=64 with
slow (long-memory) RWKV-7 gates, RMS(err)/RMS(fp32 reference):

    bf16   split=False: o 2.9e-3, final state 1.6e-3    split=True: 1e-4, 2e-6
    fp16   split=False: o 3.5e-4, final state 1.8e-4    split=True: 1e-5, 2e-7

(bf16's 2.9e-3 would eat ~40% of the end-to-end bar of 7e-3.) The GPU test
measures both settings.

Shared memory (bytes, e = dtype size, s = num_stages, p = 2 if split else 1)
--------------------------------------------------------------------------
    s * (e * (4 C K + 2 C BV + 2 C C) + 4 K)   pipelined tiles
    + p * e * (K BV + C BV)                     h and v_new GEMM operands
e.g. C=64, K=128, BV=32, bf16, split: 181 KB + 24 KB = 201 KB (1 CTA/SM);
C=64, K=128, BV=64 does not fit with split (241 KB); C=32, K=128, BV=32:
81 KB + 20 KB = 101 KB (2 CTAs/SM). See :func:`smem_bytes`.

BV trades grid size against redundant traffic: the grid has N*H*(V/BV) CTAs
and each re-reads the chunk's [C, K] tiles (from L2 for all but the first).
BV = 32 (default) gives 4 CTAs per (sequence, head) at V = 128: B=1, H=16 is
64 CTAs (half of the 132 SMs); B=2, H=32 is 256. Below ~132 CTAs a
segment-parallel split over time is the cure (DESIGN.md section 6): not
implemented here.

Signature (caller-allocated outputs; every dim but C, K, V symbolic):

    state_fwd(qg, kg, bg, w, u, v, A_qk, A_qb, gl, h0, cu_seqlens, chunk_offsets,
              o, ht, h, v_new)

qg, kg, bg, w [B, T, H, K]; u, v, o [B, T, H, V] (dtype); A_qk, A_qb
[B, T, H, C] (dtype, lower triangular incl. the diagonal within each chunk, as
``dplr::chunk_intra_fwd`` writes them; the upper triangle is not masked here);
gl [B, S, H, K] fp32 (S chunk slots); cu_seqlens, chunk_offsets int32 [N+1];
ht [N, H, K, V] fp32; h0 [N0, H, K, V] fp32 (N0 == N, or 0: start from zero);
h [Bh, Sh, H, K, V] fp32 (state at each chunk's start) and v_new [Bv, Tv, H, V]
(dtype): Sh == S and Tv == T to keep them; Sh == 0 skips both (pass both size 0).
B is 1 at call time. Unused trailing slots of h (S > chunk_offsets[N], varlen)
are written as zeros, as the reference does. Reference:
``chunk_state_fwd_reference`` in torch_dplr/ops/state.py (math in
torch_dplr/reference/state.py).
"""

# No `from __future__ import annotations`: the prim_func signatures below are built from
# local tensor types, which TileLang resolves only when annotations are real objects.
import itertools

import tilelang.language as T

from .compile import canonical_dtype, kernel_options

__all__ = ["state_fwd_kernel", "smem_bytes", "default_block_v", "variants", "ref_program",
           "CHUNK_SIZES", "HEAD_DIMS", "DTYPES"]

CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")

_ACC = "float32"
_SMEM_LIMIT = 227 * 1024  # sm_90a opt-in shared memory per block


def smem_bytes(C: int, K: int, BV: int, dtype: str, split: bool = True, num_stages: int = 2) -> int:
    """Shared memory the kernel allocates (without TileLang's small alignment slack)."""
    e = 2  # bf16 / fp16
    stage = e * (4 * C * K + 2 * C * BV + 2 * C * C) + 4 * K
    parts = 2 if split else 1
    return max(1, num_stages) * stage + parts * e * (K * BV + C * BV)


def default_block_v(C: int, K: int, V: int, dtype: str, split: bool = True) -> int:
    """BV = 32 (grid fill, see the module docstring) unless V is smaller."""
    return min(32, V)


def _default_threads(C: int, K: int, BV: int) -> int:
    return 128


# Warp specialization off: TileLang 0.1.15 moved the fragment -> shared conversion of the
# loop-carried state into the producer warps (which hold a stale copy of h). TMA off: with
# symbolic shapes its descriptors would be encoded on the host at every launch.
_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True}


@kernel_options(pass_configs=_PASS_CONFIGS)
def state_fwd_kernel(
    C: int,
    K: int,
    V: int,
    dtype: str,
    split: bool = True,
    BV: int = 0,
    threads: int = 0,
    num_stages: int = 2,
):
    """prim_func ``state_fwd(...)`` for one static config (signature in the module docstring).

    C: chunk size (16, 32, 64); K, V: head dims (multiples of 16, <= 256);
    dtype: bf16 / fp16 data; split: hi/lo split of h and v_new in the GEMMs
    (see the module docstring). Whether h0 is read and h / v_new are written is
    decided per call from their sizes. Schedule knobs (same results up to
    rounding order): BV (0: :func:`default_block_v`), threads (0: default),
    num_stages (2: prefetch the next chunk; 1: no prefetch).
    """
    dtype = canonical_dtype(dtype)
    if C not in CHUNK_SIZES:
        raise ValueError(f"chunk size C={C} not in {CHUNK_SIZES}")
    for name, d in (("K", K), ("V", V)):
        if d % 16 or not 16 <= d <= 256:
            raise ValueError(f"{name}={d}: need a multiple of 16 in [16, 256]")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    BV = BV or default_block_v(C, K, V, dtype, split)
    if BV % 16 or V % BV:
        raise ValueError(f"BV={BV}: need a multiple of 16 dividing V={V}")
    threads = threads or _default_threads(C, K, BV)
    need = smem_bytes(C, K, BV, dtype, split, num_stages)
    if need > _SMEM_LIMIT:
        raise ValueError(f"C={C}, K={K}, BV={BV}, split={split}, num_stages={num_stages}: "
                         f"{need} bytes of shared memory > {_SMEM_LIMIT}")
    NV = V // BV

    B, Tn, H, S, N = T.dynamic("B, T, H, S, N")
    N0, N1, Bh, Sh, Bv, Tv = T.dynamic("N0, N1, Bh, Sh, Bv, Tv")

    nbuf = 2 if num_stages >= 2 else 1
    GROUPS = 9  # cp.async commit groups per chunk: one per T.async_copy in load_chunk
    NOWAIT = {"wg_wait": -1}  # issue a wgmma without waiting (T.wait_wgmma joins)

    @T.macro
    def load_chunk(qg, kg, bg, w, u, v, A_qk, A_qb, gl, i_b, t0, slot, i_h, v0, buf,
                   qg_s, kg_s, bg_s, w_s, u_s, v_s, Aqk_s, Aqb_s, gl_s):
        # cp.async of one chunk's tiles into buffer `buf`; rows past T are zero-filled.
        # Each T.async_copy is one commit group; nothing waits here.
        T.async_copy(w[i_b, t0 : t0 + C, i_h, :], w_s[buf, :, :])
        T.async_copy(qg[i_b, t0 : t0 + C, i_h, :], qg_s[buf, :, :])
        T.async_copy(u[i_b, t0 : t0 + C, i_h, v0 : v0 + BV], u_s[buf, :, :])
        T.async_copy(v[i_b, t0 : t0 + C, i_h, v0 : v0 + BV], v_s[buf, :, :])
        T.async_copy(A_qk[i_b, t0 : t0 + C, i_h, :], Aqk_s[buf, :, :])
        T.async_copy(kg[i_b, t0 : t0 + C, i_h, :], kg_s[buf, :, :])
        T.async_copy(gl[i_b, slot, i_h, :], gl_s[buf, :])
        T.async_copy(A_qb[i_b, t0 : t0 + C, i_h, :], Aqb_s[buf, :, :])
        T.async_copy(bg[i_b, t0 : t0 + C, i_h, :], bg_s[buf, :, :])

    @T.macro
    def split_store(x, hi, lo, i, j):
        # fp32 value -> dtype GEMM operand(s): hi = dtype(x) (+ lo = dtype(x - hi))
        hi[i, j] = T.Cast(dtype, x)
        if split:
            lo[i, j] = T.Cast(dtype, x - T.Cast(_ACC, T.Cast(dtype, x)))

    @T.prim_func
    def state_fwd(
        qg: T.Tensor((B, Tn, H, K), dtype),
        kg: T.Tensor((B, Tn, H, K), dtype),
        bg: T.Tensor((B, Tn, H, K), dtype),
        w: T.Tensor((B, Tn, H, K), dtype),
        u: T.Tensor((B, Tn, H, V), dtype),
        v: T.Tensor((B, Tn, H, V), dtype),
        A_qk: T.Tensor((B, Tn, H, C), dtype),
        A_qb: T.Tensor((B, Tn, H, C), dtype),
        gl: T.Tensor((B, S, H, K), _ACC),
        h0: T.Tensor((N0, H, K, V), _ACC),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        o: T.Tensor((B, Tn, H, V), dtype),
        ht: T.Tensor((N, H, K, V), _ACC),
        h: T.Tensor((Bh, Sh, H, K, V), _ACC),
        v_new: T.Tensor((Bv, Tv, H, V), dtype),
    ):
        with T.Kernel(NV, H, N, threads=threads) as (i_v, i_h, i_n):
            v0 = i_v * BV

            # pipelined input tiles (nbuf copies)
            qg_s = T.alloc_shared((nbuf, C, K), dtype)
            kg_s = T.alloc_shared((nbuf, C, K), dtype)
            bg_s = T.alloc_shared((nbuf, C, K), dtype)
            w_s = T.alloc_shared((nbuf, C, K), dtype)
            u_s = T.alloc_shared((nbuf, C, BV), dtype)
            v_s = T.alloc_shared((nbuf, C, BV), dtype)
            Aqk_s = T.alloc_shared((nbuf, C, C), dtype)
            Aqb_s = T.alloc_shared((nbuf, C, C), dtype)
            gl_s = T.alloc_shared((nbuf, K), _ACC)
            # fp32 state / v_new as GEMM operands: hi (and lo) terms
            hh_s = T.alloc_shared((K, BV), dtype)
            vh_s = T.alloc_shared((C, BV), dtype)
            hl_s = None
            vl_s = None
            if split:
                hl_s = T.alloc_shared((K, BV), dtype)
                vl_s = T.alloc_shared((C, BV), dtype)

            h_f = T.alloc_fragment((K, BV), _ACC)
            vn_f = T.alloc_fragment((C, BV), _ACC)
            o_f = T.alloc_fragment((C, BV), _ACC)

            i_b = 0
            bos = cu_seqlens[i_n]
            eos = cu_seqlens[i_n + 1]
            boh = chunk_offsets[i_n]
            n_chunks = chunk_offsets[i_n + 1] - boh

            if N0 > 0:  # an initial state was passed
                T.copy(h0[i_n, i_h, :, v0 : v0 + BV], h_f)
            else:
                T.clear(h_f)

            if nbuf == 2:
                if n_chunks > 0:
                    load_chunk(qg, kg, bg, w, u, v, A_qk, A_qb, gl, i_b, bos, boh, i_h, v0, 0,
                               qg_s, kg_s, bg_s, w_s, u_s, v_s, Aqk_s, Aqb_s, gl_s)

            for c in T.serial(n_chunks):
                t0 = bos + c * C
                cur = c % nbuf
                # Every thread is done with chunk c-1 (its GEMMs were waited for), so the
                # other buffer is free: prefetch chunk c+1 into it, then wait for chunk c.
                T.sync_threads()
                if nbuf == 2:
                    if c + 1 < n_chunks:
                        load_chunk(qg, kg, bg, w, u, v, A_qk, A_qb, gl, i_b, t0 + C, boh + c + 1,
                                   i_h, v0, 1 - cur,
                                   qg_s, kg_s, bg_s, w_s, u_s, v_s, Aqk_s, Aqb_s, gl_s)
                        T.ptx_wait_group(GROUPS)
                    else:
                        T.ptx_wait_group(0)
                else:
                    load_chunk(qg, kg, bg, w, u, v, A_qk, A_qb, gl, i_b, t0, boh + c, i_h, v0, 0,
                               qg_s, kg_s, bg_s, w_s, u_s, v_s, Aqk_s, Aqb_s, gl_s)
                    T.ptx_wait_group(0)
                T.sync_threads()

                # a sequence's last chunk: the rows past its end hold the next
                # sequence's tokens; zero v, kg and bg there (kg^T v and bg^T v_new
                # would see them: a zero row of v alone leaves 0 * NaN when the next
                # sequence's gated rows are not finite). w, u, qg, A rows there only
                # reach v_new / o rows that are masked or not stored.
                if t0 + C > eos:
                    for i, j in T.Parallel(C, BV):
                        if t0 + i >= eos:
                            v_s[cur, i, j] = T.cast(0, dtype)
                    for i, kk in T.Parallel(C, K):
                        if t0 + i >= eos:
                            kg_s[cur, i, kk] = T.cast(0, dtype)
                            bg_s[cur, i, kk] = T.cast(0, dtype)

                # h (chunk start) -> GEMM operand(s); keep it if asked
                for k, j in T.Parallel(K, BV):
                    split_store(h_f[k, j], hh_s, hl_s, k, j)
                if Sh > 0:  # activations kept
                    T.copy(h_f, h[i_b, boh + c, i_h, :, v0 : v0 + BV])
                # decay now (gl <= 0), so no register of an in-flight wgmma is touched below
                for k, j in T.Parallel(K, BV):
                    h_f[k, j] = h_f[k, j] * T.exp2(gl_s[cur, k])
                T.sync_threads()

                # ---- phase 1 (async wgmma): v_new = w h, o = qg h + A_qk v, h += kg^T v ----
                T.gemm(w_s[cur, :, :], hh_s, vn_f, clear_accum=True, annotations=NOWAIT)
                if split:
                    T.gemm(w_s[cur, :, :], hl_s, vn_f, annotations=NOWAIT)
                T.gemm(qg_s[cur, :, :], hh_s, o_f, clear_accum=True, annotations=NOWAIT)
                if split:
                    T.gemm(qg_s[cur, :, :], hl_s, o_f, annotations=NOWAIT)
                T.gemm(Aqk_s[cur, :, :], v_s[cur, :, :], o_f, annotations=NOWAIT)
                T.gemm(kg_s[cur, :, :], v_s[cur, :, :], h_f, transpose_A=True, annotations=NOWAIT)
                T.wait_wgmma(0)

                # ---- v_new = u + w h; rows past the sequence end are 0 ----
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = T.if_then_else(t0 + i < eos,
                                                vn_f[i, j] + T.Cast(_ACC, u_s[cur, i, j]),
                                                T.float32(0))
                for i, j in T.Parallel(C, BV):
                    split_store(vn_f[i, j], vh_s, vl_s, i, j)
                if Sh > 0:
                    for i, j in T.Parallel(C, BV):
                        if t0 + i < eos:
                            v_new[i_b, t0 + i, i_h, v0 + j] = T.Cast(dtype, vn_f[i, j])
                T.sync_threads()

                # ---- phase 2 (async wgmma): o += A_qb v_new, h += bg^T v_new ----
                if split:
                    T.gemm(Aqb_s[cur, :, :], vl_s, o_f, annotations=NOWAIT)
                T.gemm(Aqb_s[cur, :, :], vh_s, o_f, annotations=NOWAIT)
                if split:
                    T.gemm(bg_s[cur, :, :], vl_s, h_f, transpose_A=True, annotations=NOWAIT)
                T.gemm(bg_s[cur, :, :], vh_s, h_f, transpose_A=True, annotations=NOWAIT)
                T.wait_wgmma(0)

                for i, j in T.Parallel(C, BV):
                    if t0 + i < eos:
                        o[i_b, t0 + i, i_h, v0 + j] = T.Cast(dtype, o_f[i, j])

            T.copy(h_f, ht[i_n, i_h, :, v0 : v0 + BV])

            # slots past the last sequence's chunks hold no chunk: zero, as the reference
            if Sh > 0:
                if i_n == N - 1:
                    for s in T.serial(chunk_offsets[i_n + 1], Sh):
                        for k, j in T.Parallel(K, BV):
                            h[0, s, i_h, k, v0 + j] = T.float32(0)

    return state_fwd


def variants():
    """Every config the dispatch builds (the compile test builds them all): C x K=V x dtype."""
    for C, K, dt in itertools.product(CHUNK_SIZES, HEAD_DIMS, DTYPES):
        yield dict(C=C, K=K, V=K, dtype=dt)


def ref_program(*args, **kwargs):
    """The contract: ``torch_dplr.ops.state.chunk_state_fwd_reference`` (same arguments as the op)."""
    from torch_dplr.ops.state import chunk_state_fwd_reference

    return chunk_state_fwd_reference(*args, **kwargs)
