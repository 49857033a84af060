"""State pass backward (``dplr::chunk_state_bwd``) for small grids: a reverse dh scan, then
per-chunk gradients.

Math: the same op as ``csrc_tl/state_bwd.py`` (its docstring states it per chunk; the oracle
is ``torch_dplr/reference/state.py::state_bwd``); ``dh`` is the gradient of the state at a
chunk's END, carried in fp32 and seeded with ``dht`` or 0.

Two kernels (one factory, ``stage``)
------------------------------------
Only the recurrence is serial, and it is column-separable in V: ``dvn`` and the update of dh
mix rows (K) and tokens, never columns. Every other output either reduces over V (dqg, dkg,
dbg, dw, dA_qk, dA_qb, dgl) or needs nothing carried. So the op runs

``stage="dh"`` (:func:`_dh_scan`), grid (V/BV, head, sequence): a CTA walks its sequence's
    chunks backwards with its K x BV slice of dh in an fp32 accumulator and per chunk writes
    dh (fp32, to a workspace ``[B, S, H, K, V]`` laid out like h: slot s holds the gradient
    of the state at chunk s's end), ``du = dvn`` (dtype), and at the end ``dh0``. Inputs
    qg, bg, w, A_qb, gl, do. V-blocks are fastest on the grid so the CTAs sharing a chunk's
    [C, K] tiles run side by side and meet in L2 (as in ``state_fwd``).

``stage="grads"`` (:func:`_chunk_grads`), one CTA per (chunk slot, head), no order: reads the
    chunk's h and dh (fp32) and tiles kg, v, v_new, du, do, A_qk, writes dv, dqg, dkg, dbg,
    dw, dA_qk, dA_qb and dgl.

When to use it: ``csrc_tl/state_bwd.py`` does the same op in one kernel, one CTA per
(sequence, head) with dh never in HBM. Where those pairs fill the GPU that kernel wins: at
the design shape B8 H32 (256 pairs) it takes 1.38 ms on the H200 against 1.52 ms for this
split (``tools/ab_state_bwd.py``), which moves 134 MB (du read back) + 2 x 268 MB (fp32 dh out and in) more.
With a small fraction of the SMs' worth of pairs (B2 H8: 16 pairs; one long sequence: 32) the
single kernel's serial walk leaves most SMs idle; here the serial scan gets V/BV times the
CTAs and ~2/3 of the traffic runs in a fully parallel kernel (on the H200, chunk 64: 0.29 vs
0.62 ms at 16 pairs, 3.67 vs 9.20 ms at 32; at 128 pairs, D128, the single kernel wins). ``torch_dplr/ops/state.py`` picks between them.

Numerics: the same as the single kernel. dh crosses HBM in fp32, so dgl = ln2·2^gl·rowsum(h
⊙ dh) is still computed from fp32 h and fp32 dh; the GEMM operands h, dh, dvn are rounded to
the input dtype once (dvn: the GEMM operand of the dh update and ``du`` are the same rounding,
and ``grads`` reads ``du`` back as the operand of dw). Every GEMM accumulates in fp32.
(Passing dh in the input dtype would halve its 536 MB but round the dh that dgl reads: CPU
emulation, T=2048, K=64, C=64, RMS relative error on dgl: bf16 1.8e-3 (RWKV-7 gates) /
0.8e-3 (unbounded), fp16 0.2e-3 / 0.55e-3, against bars of 2e-3 (bf16) and 5e-4 (fp16).)

dh scan: pipelining and masks
-----------------------------
Hand-rolled double buffer as in ``state_fwd`` (not ``T.Pipelined``, for the reasons listed
there): the six tiles of the next chunk processed (the previous one in time) are fetched
with cp.async (one commit group each) while the current chunk's GEMMs run. Per chunk::

    sync; cp.async chunk c-1 -> other buffer; wait for chunk c; sync
    [partial chunk: do rows past the end := 0]; A_qb upper triangle := 0
    dh -> dh_s (dtype) and -> HBM (fp32); dh *= 2^gl; sync
    async wgmma: dvn = A_qbᵀ·do + bg·dh_s;  dh += qgᵀ·do;  wait
    dvn rows past the end := 0; dvn -> dvn_s, du; sync
    async wgmma: dh += wᵀ·dvn_s;  wait

Rows past a sequence's end (its last chunk, the first processed) hold the next sequence's
tokens or, past T, arrive as zeros (cp.async zero-fill): zero ``do`` there (A_qbᵀ·do and
qgᵀ·do sum over rows) and the dvn rows there (wᵀ·dvn); bg, qg, w rows there then meet only
zeros. A_qb's upper triangle is zeroed (the reference applies ``tril``).

Per-chunk gradients
-------------------
Every load is issued before any math: seven cp.async groups (do, A_qk, kg, v, v_new, du, gl;
rows past T arrive as zeros) and h, dh straight into registers (fp32, 16-byte loads). dgl is made
from them while the copies land, then h and dh go to shared memory in the input dtype as GEMM
operands. ``do`` rows past chunk_len are zeroed (A_qkᵀ·do sums over rows; every other output
is row-wise and rows past chunk_len are never stored), A_qk's upper triangle too. dA_qk and
dA_qb come from one GEMM do·[v; v_new]ᵀ: v and v_new share one stacked buffer (rows 0..C and
C..2C), which for C = 16 at 256 threads is padded with zero rows to a width of 8 columns per
warp. At C = 64 the GEMMs are async wgmma issued in pairs, one wait per pair. A slot with
chunk_len 0 (varlen: past the last chunk) writes zeros to its dgl row, as the reference does.

Resources (ptxas -v sm_90a, bf16 = fp16; shared memory from :func:`shared_bytes`; CTAs per SM
on the H200: 228 KB shared, 64K registers, 1 KB reserved per CTA); no variant spills::

    stage  C   K=V  threads  shared    registers  CTAs/SM
    dh     16  64   128      20.5 KB    92        5
    dh     16  128  128      37.0 KB   118        4
    dh     32  64   128      38.5 KB   109        4
    dh     32  128  128      67.0 KB   148        3
    dh     64  64   128      80.5 KB    92        2
    dh     64  128  128     133.0 KB   167        1
    grads  16  64   128      27.0 KB   118        4
    grads  16  128  256      93.5 KB   174        1
    grads  32  64   128      38.5 KB   119        4
    grads  32  128  256     107.0 KB   178        1
    grads  64  64   128      64.5 KB   122        3
    grads  64  128  256     153.0 KB   165        1

No TMA (the descriptors of symbolic shapes would be encoded on the host every launch).

Signatures (one variant for rect and varlen: a rect batch arrives as the sequence list
[0, T, 2T, ...] of a [1, B·T, ...] view, see torch_dplr/ops/varlen.py; B is 1 at call time,
T, H, S and the N's are symbolic)::

    stage="dh":    state_bwd_dh(qg, bg, w, A_qb, gl, do, dht, cu_seqlens, chunk_offsets,
                                du, dh, dh0)
    stage="grads": state_bwd_grads(kg, v, A_qk, gl, h, v_new, do, du, dh, chunk_start,
                                   chunk_len, dqg, dkg, dbg, dw, dv, dA_qk, dA_qb, dgl)

qg, kg, bg, w, dqg, dkg, dbg, dw [B, T, H, K]; v, v_new, do, du, dv [B, T, H, V]; A_qk, A_qb,
dA_qk, dA_qb [B, T, H, C] (dA_* 0 above the diagonal); gl, dgl [B, S, H, K] fp32; h, dh
[B, S, H, K, V] fp32; dht [Nd, H, K, V] fp32 (Nd = N seeds dh, Nd = 0 starts from zero); dh0
[N0, H, K, V] fp32 (written when N0 = N; N0 = 0 skips it); cu_seqlens, chunk_offsets [N+1]
and chunk_start, chunk_len [S] int32 (:func:`torch_dplr.ops.varlen.kernel_tables`).
"""

import itertools
import math

import tilelang.language as T

from .compile import canonical_dtype, kernel_options
from .tile_macros import stack_rows, zero_rows_from

__all__ = ["state_bwd_split_kernel", "ref_program", "shared_bytes", "STAGES", "CHUNK_SIZES", "HEAD_DIMS",
           "DTYPES", "variants"]

CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
#: the op runs "dh" (reverse scan) and then "grads" (per-chunk gradients, reads dh)
STAGES = ("dh", "grads")

_ACC = "float32"
_LN2 = math.log(2.0)
_NOWAIT = {"wg_wait": -1}  # issue a wgmma without waiting; join() waits
_SMEM_LIMIT = 227 * 1024  # sm_90a opt-in shared memory per block

# Warp specialization off (hand-rolled pipelines, see state_fwd); TMA off: with symbolic
# shapes its descriptors would be encoded on the host at every launch.
_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True}


def _default_block_v(V: int) -> int:
    # dh scan: 2 V-blocks per (sequence, head) at V = 64, 4 at V = 128 (grid fill vs the
    # L2 re-reads of the [C, K] tiles, as in state_fwd)
    return min(32, V)


def _default_threads(stage: str, K: int, V: int) -> int:
    if stage == "dh":
        return 128  # one warpgroup: the K x BV dh slice is one wgmma accumulator
    # grads: h and dh [K, V] fp32 sit in registers at once (K·V/threads each)
    return 256 if K * V > 64 * 64 else 128


def shared_bytes(stage: str, C: int, K: int, V: int, BV: int = 0, threads: int = 0,
                 itemsize: int = 2) -> int:
    """Shared memory a stage allocates (before TileLang's small reduce / alignment slack)."""
    threads = threads or _default_threads(stage, K, V)
    if stage == "dh":
        BV = BV or _default_block_v(V)
        tiles = 2 * ((3 * C * K + C * C + C * BV) * itemsize + 4 * K)  # double buffer
        return tiles + (K * BV + C * BV) * itemsize  # dh_s, dvn_s
    elems = C * V * 2 + stack_rows(C, threads) * V + C * C + C * K + 2 * K * V
    return elems * itemsize + 2 * 4 * K  # + gl, dgl


def _fence_macro(threads: int):
    """Macro ``fence(acc)``: after a wgmma wait, keeps nvcc from hoisting reads of the
    accumulator ``acc`` above the wait."""

    @T.macro
    def fence(acc):
        T.warpgroup_fence_operand(acc, num_regs=acc.shape[0] * acc.shape[1] // threads)

    return fence


def _dh_scan(C: int, K: int, V: int, dtype: str, BV: int, threads: int):
    """prim_func ``state_bwd_dh``: the reverse dh recurrence, dh per chunk, du, dh0."""
    NV = V // BV
    B, Tn, H, S = T.dynamic("B, T, H, S")
    Nd, N0, Ncu = T.dynamic("Nd, N0, Ncu")
    GROUPS = 6  # cp.async commit groups per chunk: one per T.async_copy in load_chunk
    dvn_wgmma = C % 64 == 0  # the [C, BV] GEMMs; the [K, BV] ones (K >= 64) always are
    fence = _fence_macro(threads)

    @T.macro
    def load_chunk(qg, bg, w, A_qb, gl, do, t0, slot, i_h, v0, buf,
                   qg_s, bg_s, w_s, Aqb_s, gl_s, do_s):
        # in the order the chunk reads them; rows past T are zero-filled, nothing waits here
        T.async_copy(A_qb[0, t0 : t0 + C, i_h, :], Aqb_s[buf, :, :], coalesced_width=8)
        T.async_copy(do[0, t0 : t0 + C, i_h, v0 : v0 + BV], do_s[buf, :, :])
        T.async_copy(bg[0, t0 : t0 + C, i_h, :], bg_s[buf, :, :])
        T.async_copy(qg[0, t0 : t0 + C, i_h, :], qg_s[buf, :, :])
        T.async_copy(gl[0, slot, i_h, :], gl_s[buf, :])
        T.async_copy(w[0, t0 : t0 + C, i_h, :], w_s[buf, :, :])

    @T.prim_func
    def state_bwd_dh(
        qg: T.Tensor((B, Tn, H, K), dtype),
        bg: T.Tensor((B, Tn, H, K), dtype),
        w: T.Tensor((B, Tn, H, K), dtype),
        A_qb: T.Tensor((B, Tn, H, C), dtype),
        gl: T.Tensor((B, S, H, K), _ACC),
        do: T.Tensor((B, Tn, H, V), dtype),
        dht: T.Tensor((Nd, H, K, V), _ACC),
        cu_seqlens: T.Tensor((Ncu,), "int32"),
        chunk_offsets: T.Tensor((Ncu,), "int32"),
        du: T.Tensor((B, Tn, H, V), dtype),
        dh: T.Tensor((B, S, H, K, V), _ACC),
        dh0: T.Tensor((N0, H, K, V), _ACC),
    ):
        with T.Kernel(NV, H, Ncu - 1, threads=threads) as (i_v, i_h, i_n):
            v0 = i_v * BV
            qg_s = T.alloc_shared((2, C, K), dtype)
            bg_s = T.alloc_shared((2, C, K), dtype)
            w_s = T.alloc_shared((2, C, K), dtype)
            Aqb_s = T.alloc_shared((2, C, C), dtype)
            do_s = T.alloc_shared((2, C, BV), dtype)
            gl_s = T.alloc_shared((2, K), _ACC)
            dh_s = T.alloc_shared((K, BV), dtype)  # dh at the chunk end, GEMM operand
            dvn_s = T.alloc_shared((C, BV), dtype)
            dh_f = T.alloc_fragment((K, BV), _ACC)  # the carried gradient
            dvn_f = T.alloc_fragment((C, BV), _ACC)

            bos = cu_seqlens[i_n]
            eos = cu_seqlens[i_n + 1]
            s0 = chunk_offsets[i_n]
            nc = chunk_offsets[i_n + 1] - s0

            if Nd > 0:
                T.copy(dht[i_n, i_h, :, v0 : v0 + BV], dh_f)
            else:
                T.clear(dh_f)
            if nc > 0:  # the sequence's last chunk, the first processed
                load_chunk(qg, bg, w, A_qb, gl, do, bos + (nc - 1) * C, s0 + nc - 1, i_h, v0, 0,
                           qg_s, bg_s, w_s, Aqb_s, gl_s, do_s)

            for it in T.serial(nc):
                c = nc - 1 - it
                t0 = bos + c * C
                slot = s0 + c
                cur = it % 2
                # every thread is done with the previous chunk (its GEMMs were joined): the
                # other buffer is free for the chunk before this one
                T.sync_threads()
                if it + 1 < nc:
                    load_chunk(qg, bg, w, A_qb, gl, do, t0 - C, slot - 1, i_h, v0, 1 - cur,
                               qg_s, bg_s, w_s, Aqb_s, gl_s, do_s)
                    T.ptx_wait_group(GROUPS)
                else:
                    T.ptx_wait_group(0)
                T.sync_threads()

                # rows past the sequence end: the next sequence's tokens (or zero past T)
                if t0 + C > eos:
                    for i, j in T.Parallel(C, BV):
                        if t0 + i >= eos:
                            do_s[cur, i, j] = T.cast(0, dtype)
                for i, j in T.Parallel(C, C):
                    if j > i:
                        Aqb_s[cur, i, j] = T.cast(0, dtype)
                # dh at this chunk's end: GEMM operand, and to HBM for the grads stage
                for k, j in T.Parallel(K, BV):
                    dh_s[k, j] = T.Cast(dtype, dh_f[k, j])
                T.copy(dh_f, dh[0, slot, i_h, :, v0 : v0 + BV])
                # decay now, before any wgmma holds dh_f's registers
                for k, j in T.Parallel(K, BV):
                    dh_f[k, j] = dh_f[k, j] * T.exp2(gl_s[cur, k])
                T.sync_threads()

                # ---- dvn = A_qbᵀ·do + bg·dh;  dh += qgᵀ·do ----
                T.gemm(Aqb_s[cur, :, :], do_s[cur, :, :], dvn_f, transpose_A=True,
                       clear_accum=True, annotations=_NOWAIT)
                T.gemm(bg_s[cur, :, :], dh_s, dvn_f, annotations=_NOWAIT)
                T.gemm(qg_s[cur, :, :], do_s[cur, :, :], dh_f, transpose_A=True,
                       annotations=_NOWAIT)
                T.wait_wgmma(0)
                fence(dh_f)
                if dvn_wgmma:
                    fence(dvn_f)

                # ---- du = dvn (operand rows past the end are 0: wᵀ·dvn sums over rows) ----
                for i, j in T.Parallel(C, BV):
                    dvn_s[i, j] = T.Cast(dtype, T.if_then_else(t0 + i < eos, dvn_f[i, j], T.float32(0)))
                for i, j in T.Parallel(C, BV):
                    if t0 + i < eos:
                        du[0, t0 + i, i_h, v0 + j] = T.Cast(dtype, dvn_f[i, j])
                T.sync_threads()

                # ---- dh += wᵀ·dvn ----
                T.gemm(w_s[cur, :, :], dvn_s, dh_f, transpose_A=True, annotations=_NOWAIT)
                T.wait_wgmma(0)
                fence(dh_f)

            if N0 > 0:
                T.copy(dh_f, dh0[i_n, i_h, :, v0 : v0 + BV])

    return state_bwd_dh


def _chunk_grads(C: int, K: int, V: int, dtype: str, threads: int):
    """prim_func ``state_bwd_grads``: every output but du and dh0, one CTA per (slot, head)."""
    R = stack_rows(C, threads)
    wgmma = C % 64 == 0 and threads % 128 == 0  # the [C, *] GEMMs
    nowait = _NOWAIT if wgmma else None
    B, Tn, H, S = T.dynamic("B, T, H, S")
    ln2 = T.float32(_LN2)
    fence = _fence_macro(threads)

    zero_rows = zero_rows_from(C)  # rows L.. of a partial chunk's staged tile := 0

    @T.macro
    def join(acc, acc2):
        # wait for a pair of async wgmma GEMMs (mma.sync ones are done already)
        if wgmma:
            T.wait_wgmma(0)
            fence(acc)
            fence(acc2)

    @T.macro
    def copy_rows(src, i_h, t0, dst):
        # cp.async of the chunk's C rows (one commit group); rows past T arrive as zeros
        T.async_copy(src[0, t0 : t0 + C, i_h, :], dst)

    @T.macro
    def store_rows(frag, out, i_h, t0, L):
        # the slot's L rows; nothing past them
        for i, j in T.Parallel(*frag.shape):
            if i < L:
                out[0, t0 + i, i_h, j] = T.Cast(dtype, frag[i, j])

    @T.macro
    def store_tril(frag, j0, out, i_h, t0, L):
        # columns j0 .. j0+C of frag, lower triangle incl. the diagonal, zeros above
        for i, j in T.Parallel(C, C):
            if i < L:
                out[0, t0 + i, i_h, j] = T.if_then_else(j <= i, T.Cast(dtype, frag[i, j0 + j]),
                                                        T.Cast(dtype, 0))

    @T.prim_func
    def state_bwd_grads(
        kg: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, H, V), dtype),
        A_qk: T.Tensor((B, Tn, H, C), dtype),
        gl: T.Tensor((B, S, H, K), _ACC),
        h: T.Tensor((B, S, H, K, V), _ACC),
        v_new: T.Tensor((B, Tn, H, V), dtype),
        do: T.Tensor((B, Tn, H, V), dtype),
        du: T.Tensor((B, Tn, H, V), dtype),
        dh: T.Tensor((B, S, H, K, V), _ACC),
        chunk_start: T.Tensor((S,), "int32"),
        chunk_len: T.Tensor((S,), "int32"),
        dqg: T.Tensor((B, Tn, H, K), dtype),
        dkg: T.Tensor((B, Tn, H, K), dtype),
        dbg: T.Tensor((B, Tn, H, K), dtype),
        dw: T.Tensor((B, Tn, H, K), dtype),
        dv: T.Tensor((B, Tn, H, V), dtype),
        dA_qk: T.Tensor((B, Tn, H, C), dtype),
        dA_qb: T.Tensor((B, Tn, H, C), dtype),
        dgl: T.Tensor((B, S, H, K), _ACC),
    ):
        # (slot, head) on grid x, head fastest; x has no 65535 limit
        with T.Kernel(S * H, threads=threads) as i_sh:
            # a register, computed once (inlined, `% H` is a 64-bit remainder per access)
            i_h = T.alloc_var("int32", init=i_sh % H)
            i_s = T.alloc_var("int32", init=i_sh // H)
            t0 = chunk_start[i_s]
            L = chunk_len[i_s]

            do_s = T.alloc_shared((C, V), dtype)
            Aqk_s = T.alloc_shared((C, C), dtype)
            kg_s = T.alloc_shared((C, K), dtype)
            # v (rows 0..C) and v_new (rows C..2C) stacked: one GEMM do·[v; v_new]ᵀ makes
            # both dA's; R - 2C zero rows pad it to a width every warp can take
            vv_s = T.alloc_shared((R, V), dtype)
            du_s = T.alloc_shared((C, V), dtype)
            hb_s = T.alloc_shared((K, V), dtype)  # h at the chunk start, GEMM operand
            dhb_s = T.alloc_shared((K, V), dtype)  # dh at the chunk end, GEMM operand
            gl_s = T.alloc_shared((K,), _ACC)
            dgl_s = T.alloc_shared((K,), _ACC)
            h_f = T.alloc_fragment((K, V), _ACC)
            dh_f = T.alloc_fragment((K, V), _ACC)
            dgl_f = T.alloc_fragment((K,), _ACC)
            dv_f = T.alloc_fragment((C, V), _ACC)
            dq_f = T.alloc_fragment((C, K), _ACC)
            dk_f = T.alloc_fragment((C, K), _ACC)
            db_f = T.alloc_fragment((C, K), _ACC)
            dA_f = T.alloc_fragment((C, R), _ACC)  # [dA_qk | dA_qb | pad]
            dw_f = T.alloc_fragment((C, K), _ACC)

            if L > 0:
                # ---- every load in flight at once ----
                copy_rows(do, i_h, t0, do_s)
                # [C, C] at C = 16 is fewer 16-byte pieces than threads: pin the width
                T.async_copy(A_qk[0, t0 : t0 + C, i_h, :], Aqk_s, coalesced_width=8)
                copy_rows(kg, i_h, t0, kg_s)
                copy_rows(v, i_h, t0, vv_s[0:C, :])
                copy_rows(v_new, i_h, t0, vv_s[C : 2 * C, :])
                copy_rows(du, i_h, t0, du_s)
                T.async_copy(gl[0, i_s, i_h, :], gl_s)
                T.copy(h[0, i_s, i_h, :, :], h_f)
                T.copy(dh[0, i_s, i_h, :, :], dh_f)

                # ---- dgl = ln2 2^gl rowsum(h ⊙ dh) in fp32; h, dh -> GEMM operands ----
                for k, j in T.Parallel(K, V):
                    hb_s[k, j] = T.Cast(dtype, h_f[k, j])
                    dhb_s[k, j] = T.Cast(dtype, dh_f[k, j])
                    h_f[k, j] = h_f[k, j] * dh_f[k, j]
                T.reduce_sum(h_f, dgl_f, dim=1)
                T.copy(dgl_f, dgl_s)
                if R > 2 * C:
                    for i, j in T.Parallel(R - 2 * C, V):
                        vv_s[2 * C + i, j] = T.Cast(dtype, 0)
                T.ptx_wait_group(0)
                T.sync_threads()
                for k in T.Parallel(K):
                    dgl[0, i_s, i_h, k] = ln2 * T.exp2(gl_s[k]) * dgl_s[k]
                # A_qkᵀ·do sums over rows: rows past L (next sequence / past T) must be 0
                zero_rows(L, do_s)
                for i, j in T.Parallel(C, C):
                    if j > i:
                        Aqk_s[i, j] = T.Cast(dtype, 0)
                T.sync_threads()

                # ---- dv = A_qkᵀ·do + kg·dh;  dqg = do·hᵀ ----
                T.gemm(Aqk_s, do_s, dv_f, transpose_A=True, clear_accum=True, annotations=nowait)
                T.gemm(kg_s, dhb_s, dv_f, annotations=nowait)
                T.gemm(do_s, hb_s, dq_f, transpose_B=True, clear_accum=True, annotations=nowait)
                join(dv_f, dq_f)
                store_rows(dv_f, dv, i_h, t0, L)
                store_rows(dq_f, dqg, i_h, t0, L)

                # ---- dkg = v·dhᵀ;  dbg = v_new·dhᵀ ----
                T.gemm(vv_s[0:C, :], dhb_s, dk_f, transpose_B=True, clear_accum=True,
                       annotations=nowait)
                T.gemm(vv_s[C : 2 * C, :], dhb_s, db_f, transpose_B=True, clear_accum=True,
                       annotations=nowait)
                join(dk_f, db_f)
                store_rows(dk_f, dkg, i_h, t0, L)
                store_rows(db_f, dbg, i_h, t0, L)

                # ---- dA_qk | dA_qb = do·[v; v_new]ᵀ;  dw = du·hᵀ ----
                T.gemm(do_s, vv_s, dA_f, transpose_B=True, clear_accum=True, annotations=nowait)
                T.gemm(du_s, hb_s, dw_f, transpose_B=True, clear_accum=True, annotations=nowait)
                join(dA_f, dw_f)
                store_tril(dA_f, 0, dA_qk, i_h, t0, L)
                store_tril(dA_f, C, dA_qb, i_h, t0, L)
                store_rows(dw_f, dw, i_h, t0, L)
            else:
                # an unused slot (varlen, past the last chunk): zeros, as the reference
                for k in T.Parallel(K):
                    dgl[0, i_s, i_h, k] = T.float32(0)

    return state_bwd_grads


@kernel_options(pass_configs=_PASS_CONFIGS)
def state_bwd_split_kernel(
    C: int,
    K: int,
    V: int,
    dtype: str,
    stage: str = "grads",
    BV: int = 0,
    threads: int = 0,
):
    """prim_func of one stage of the state-pass backward (signatures in the module docstring).

    C: chunk size (16, 32, 64); K, V: head dims (64, 128); dtype: bf16 / fp16 (the dtype of
    every [B, T, H, *] tensor); stage: "dh" (reverse scan: dh per chunk, du, dh0) or "grads"
    (the other outputs, from h and dh). Schedule knobs (same results): BV (dh stage, 0: 32
    or V if smaller), threads (0: 128; grads at K = V = 128: 256).
    """
    dtype = canonical_dtype(dtype)
    if C not in CHUNK_SIZES:
        raise ValueError(f"chunk size C={C} not in {CHUNK_SIZES}")
    for name, d in (("K", K), ("V", V)):
        if d not in HEAD_DIMS:
            raise ValueError(f"{name}={d} not in {HEAD_DIMS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} not in {STAGES}")
    threads = threads or _default_threads(stage, K, V)
    if threads not in (128, 256):
        raise ValueError(f"threads={threads} not in (128, 256)")
    if stage == "dh":
        BV = BV or _default_block_v(V)
        if BV % 16 or V % BV:
            raise ValueError(f"BV={BV}: need a multiple of 16 dividing V={V}")
    need = shared_bytes(stage, C, K, V, BV, threads)
    if need > _SMEM_LIMIT:
        raise ValueError(f"stage={stage}, C={C}, K={K}, V={V}, BV={BV}: {need} bytes of "
                         f"shared memory > {_SMEM_LIMIT}")
    if stage == "dh":
        return _dh_scan(C, K, V, dtype, BV, threads)
    return _chunk_grads(C, K, V, dtype, threads)


def variants():
    """Every config the dispatch builds (and the CI compiles): stage x C x K=V x dtype."""
    for stage, C, K, dt in itertools.product(STAGES, CHUNK_SIZES, HEAD_DIMS, DTYPES):
        yield dict(C=C, K=K, V=K, dtype=dt, stage=stage)


def ref_program(*args, **kwargs):
    """The contract of the two stages run in order: ``torch_dplr.ops.state.
    chunk_state_bwd_reference`` (same argument order up to ``dht``, then ``initial_state,
    cu_seqlens, chunk_size, use_initial_state, use_dht``); the math is
    ``torch_dplr.reference.state.state_bwd``."""
    from torch_dplr.ops.state import chunk_state_bwd_reference

    return chunk_state_bwd_reference(*args, **kwargs)
