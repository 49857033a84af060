"""State pass backward (``dplr::chunk_state_bwd``): one reverse sweep over each sequence's chunks.

Math (per chunk, ``h`` = state at the chunk's start, ``dh`` = gradient of the state at the
chunk's END, carried in fp32 and seeded with ``dht`` or 0; see
``torch_dplr/reference/state.py::state_bwd``)::

    dvn = A_qbᵀ·do + bg·dh            du = dvn
    dv  = A_qkᵀ·do + kg·dh
    dA_qk = tril(do·vᵀ)               dA_qb = tril(do·v_newᵀ)
    dqg = do·hᵀ     dkg = v·dhᵀ       dbg = v_new·dhᵀ        dw = dvn·hᵀ
    dgl = ln2 · 2^gl ⊙ rowsum(h ⊙ dh)
    dh  <- qgᵀ·do + 2^gl ⊙ dh + wᵀ·dvn                       (dh0 = dh after the first chunk)

``gl <= 0`` (log2 units), so the only exponent here, ``2^gl``, is at most 1 for every gate
style: no centring and no overflow risk in this stage.

Grid: one CTA per (head, sequence), whole K and V
--------------------------------------------------
The dh recurrence is column-separable in V (a V-split would run it independently per block),
but six of the outputs reduce over V (dqg, dkg, dbg, dw, dA_qk, dA_qb, dgl): a V-split needs
fp32 atomics (non-deterministic; opcheck's aot test compares eager and compiled runs) or a
workspace plus a second pass. K cannot be split at all (dvn = bg·dh needs every row of dh).
So one CTA owns a (sequence, head) pair with dh [K, V] fp32 in registers (64 regs/thread at
K = V = 128 with 256 threads) and walks the sequence's chunks backwards. Nothing of dh goes
to HBM. When N·H is below the SM count the GPU is under-filled; the cure is segment
parallelism over time (DESIGN §6), which is a different kernel.

Per chunk every GEMM operand lives in shared memory in the input dtype: the tiles of the
chunk, dh (rounded from the fp32 carry), h (rounded from fp32) and dvn. h (fp32 in HBM) is
read straight into registers in dh's fragment layout, so dgl = ln2·2^gl·rowsum(h ⊙ dh) is
computed from fp32 h and fp32 dh; the carried dh never leaves fp32. Every GEMM accumulates
in fp32 and every output is rounded once. (Rounding the fp32 operands h, dh, dvn to bf16
adds ~2e-3 RMS relative error to dqg/dkg/dbg/dw, about as much as rounding the outputs;
see tests/test_tl_state_bwd.py for the bars.)

dA_qk and dA_qb come from one GEMM do·[v; v_new]ᵀ: v and v_new share one stacked buffer
(rows 0..C and C..2C), which for C = 16 is padded with zero rows to a width of 8 columns
per warp (an m16n8 tile per warp; a 16 x 16 GEMM cannot be spread over 8 warps).

Pipelining: single-buffered, each buffer refilled as soon as it is free
------------------------------------------------------------------------
A chunk's tiles (C=64, K=V=128, bf16: 4×16 KB [C,K] + 3×16 KB [C,V] + 2×8 KB [C,C] + 64 KB of
fp32 h) do not fit twice in 227 KB. Instead every input tile of the previous chunk (the next
one processed) is fetched with cp.async into its buffer as soon as the current chunk's last
reader of that buffer is done, and the work of a chunk is ordered so that buffers free up
early:

    wait(batches A, B) . h -> registers (loads in flight) . mask tril(A_qk, A_qb) . dh_s
    dvn = du (A_qb, bg), dv (A_qk, kg)        [h columns 0..V/2: dgl part, hb_s]
                                               -> batch A: bg, A_qb, kg, A_qk
    wait(v, v_new) . dA_qk | dA_qb . h (rest): dgl, hb_s . dh *= 2^gl
    dqg . dh += qgᵀ·do                         -> batch B: qg, do, gl
    dkg, dbg, dw . wait(w) . dh += wᵀ·dvn      -> batch C: v, v_new, w

Batch A overlaps half a chunk of math, batch B a third, batch C the first GEMMs of the next
chunk (it is waited for only when v / w are needed). The loads of h into registers are
issued at the top of the chunk and first consumed after the dvn / dv GEMMs (``h_parts`` = 2,
the default at C=64, K=128 to fit 255 registers: one column half there, the other loaded
then and consumed after the dA GEMM) or after the dA GEMM (``h_parts`` = 1). cp.async wait counts are static (one commit group per
``T.async_copy``); a sequence's last chunk (c = 0) issues no prefetch and waits with the
smaller counts.

The first chunk processed (the sequence's last, the only one that may be partial) is loaded
in the prologue with predicated loads that zero rows past the sequence end, so every
cp.async in the loop copies a full, in-bounds chunk and every GEMM sees zero rows past the
end (no masking inside the loop); rows past the end are never stored. ``A_qk`` / ``A_qb`` are
masked to their lower triangle in shared memory after each load (the reference applies
``tril``; nothing above the diagonal is trusted).

Shared memory (:func:`shared_bytes`; input dtype): 4·C·K + 2·C·V (do, dvn) + R·V (v; v_new;
pad) + 2·C·C + 2·K·V (dh, h) elements plus K fp32: bf16 C=64, K=V=128: 208.5 KB (1 CTA/SM);
C=32: 132.5 KB; C=16: 105.5 KB; K=V=64: C=64 96.3 KB, C=32 52.3 KB, C=16 33.3 KB.
Registers (ptxas -v, sm_90a, bf16): K=V=128 with 256 threads 220-255, K=V=64 with 128
threads 160-203; no variant spills.
No TMA (the descriptors of symbolic shapes would be encoded on the host every launch).

Shapes (one variant for rect and varlen: a rect batch arrives as the sequence list
[0, T, 2T, ...] of a [1, B·T, ...] view, see torch_dplr/ops/varlen.py): qg, kg, bg, w
[B, T, H, K]; v, v_new, do [B, T, H, V]; A_qk, A_qb [B, T, H, C]; gl [B, S, H, K] fp32;
h [B, S, H, K, V] fp32; dht [Nd, H, K, V] fp32 (Nd = N seeds dh, Nd = 0 starts from zero);
cu_seqlens, chunk_offsets [N+1] int32; outputs dqg, dkg, dbg, dw [B, T, H, K]; du, dv
[B, T, H, V]; dA_qk, dA_qb [B, T, H, C] (0 above the diagonal); dgl [B, S, H, K] fp32;
dh0 [N0, H, K, V] fp32 (written when N0 = N; N0 = 0 skips it). B is 1 at call time;
T, H, S and the N's are symbolic. The unused trailing slots of dgl (S - chunk_offsets[N]
of them) are written as zeros, as the reference does.
"""

import itertools
import math

import tilelang.language as T

from .compile import canonical_dtype, kernel_options
from .tile_macros import stack_rows

__all__ = ["state_bwd_kernel", "ref_program", "shared_bytes", "CHUNK_SIZES", "HEAD_DIMS", "DTYPES", "variants"]

CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")

_ACC = "float32"
_LN2 = math.log(2.0)
# commit groups per prefetch batch (one per T.async_copy)
_NA, _NB, _NC = 4, 3, 3
# dh GEMMs split K (rows) over the warps, so a row of dh lives in one quad of threads and
# rowsum(h ⊙ dh) needs no barrier
_ROWS = T.GemmWarpPolicy.FullRow


def _default_threads(K: int, V: int) -> int:
    # dh [K, V] fp32 lives in registers for the whole sweep and h [K, V] fp32 for part of
    # each chunk: K·V/threads registers each (64 at K = V = 128 with two warpgroups).
    return 256 if K * V > 64 * 64 else 128


def _column_block_layout(K: int, VP: int, threads: int):
    """The register layout of columns 0..VP of the fp32 dh accumulator ([K, V], one 16-row
    m16n8 strip per warp, FullRow): element (k, j) lives in thread (k // 16)·32 + (k % 8)·4 +
    (j % 8) // 2 at index (j // 8)·4 + ((k % 16) // 8)·2 + j % 2."""
    from tilelang.layout import Fragment

    if K != 16 * (threads // 32):
        raise ValueError(f"h_parts=2 needs one 16-row strip of dh per warp (K={K}, threads={threads})")

    def thread_and_index(k, j):
        return ((k // 16) * 32 + (k % 8) * 4 + (j % 8) // 2,
                (j // 8) * 4 + ((k % 16) // 8) * 2 + j % 2)

    return Fragment((K, VP), forward_fn=thread_and_index)


def shared_bytes(C: int, K: int, V: int, threads: int = 0, itemsize: int = 2) -> int:
    """Shared memory the kernel allocates (before TileLang's small reduce workspace)."""
    threads = threads or _default_threads(K, V)
    elems = 4 * C * K + 2 * C * V + stack_rows(C, threads) * V + 2 * C * C + 2 * K * V
    return elems * itemsize + 4 * K


@kernel_options(pass_configs=None)
def state_bwd_kernel(
    C: int,
    K: int,
    V: int,
    dtype: str,
    threads: int = 0,
    h_parts: int = 0,
):
    """prim_func ``state_bwd(qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, do, dht, cu_seqlens,
    chunk_offsets, dqg, dkg, dbg, dw, du, dv, dA_qk, dA_qb, dgl, dh0)``.

    C: chunk size (16, 32, 64); K, V: head dims (64, 128); dtype: bf16 / fp16 (the dtype of
    every [B, T, H, *] tensor). One CTA per (head, cu_seqlens sequence); dh starts from dht
    when it has rows (Nd > 0) and dh0 is written when it has rows (N0 > 0), decided at run time.
    Schedule knobs (same results): threads (0: 256 for K = V = 128, 128 for 64); h_parts
    (0: 2 for C = 64, K = 128, else 1): column blocks in which h is loaded into registers.
    """
    dtype = canonical_dtype(dtype)
    if C not in CHUNK_SIZES:
        raise ValueError(f"chunk size C={C} not in {CHUNK_SIZES}")
    for name, d in (("K", K), ("V", V)):
        if d not in HEAD_DIMS:
            raise ValueError(f"{name}={d} not in {HEAD_DIMS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    threads = threads or _default_threads(K, V)
    if threads not in (128, 256):
        # dh rows are split over the warps (FullRow); more than two warpgroups cannot hold
        # the 128 rows with wgmma, fewer than K*V/128 registers per thread do not fit
        raise ValueError(f"threads={threads} not in (128, 256)")
    h_parts = h_parts or (2 if C == 64 and K == 128 else 1)
    if h_parts not in (1, 2):
        raise ValueError(f"h_parts={h_parts} not in (1, 2)")
    VP = V // h_parts
    R = stack_rows(C, threads)
    rows = _ROWS

    B, Tn, H, S = T.dynamic("B, T, H, S")
    Nd, N0, Ncu = T.dynamic("Nd, N0, Ncu")
    ln2 = T.float32(_LN2)

    @T.macro
    def store_rows(frag, out, i_b, t0, i_h, ln):
        # rows past the sequence end are never written
        for i, j in T.Parallel(*frag.shape):
            if i < ln:
                out[i_b, t0 + i, i_h, j] = T.Cast(dtype, frag[i, j])

    @T.macro
    def store_tril(frag, j0, out, i_b, t0, i_h, ln):
        # columns j0 .. j0+C of frag, lower triangle incl. the diagonal, zeros above
        for i, j in T.Parallel(C, C):
            if i < ln:
                out[i_b, t0 + i, i_h, j] = T.if_then_else(j <= i, T.Cast(dtype, frag[i, j0 + j]), T.Cast(dtype, 0))

    @T.macro
    def load_rows(src, dst, i_b, t0, i_h, ln):
        # predicated load of a possibly partial chunk; rows past the end read as zero
        for i, j in T.Parallel(*dst.shape):
            dst[i, j] = T.if_then_else(i < ln, src[i_b, t0 + i, i_h, j], T.Cast(dtype, 0))

    @T.macro
    def use_h(hf, part, hb_s, dh, dgl_f, dgl_s, gl_s, dgl, i_b, slot, i_h):
        # columns part*VP .. (part+1)*VP of h: to shared in the input dtype, and their share
        # of rowsum(h ⊙ dh) in fp32; the last part writes dgl, staged through shared memory.
        for k, j in T.Parallel(K, VP):
            hb_s[k, part * VP + j] = T.Cast(dtype, hf[k, j])
            hf[k, j] = hf[k, j] * dh[k, part * VP + j]
        T.reduce_sum(hf, dgl_f, dim=1, clear=(part == 0))
        if part == h_parts - 1:
            T.copy(dgl_f, dgl_s)
            T.sync_threads()
            for k in T.Parallel(K):
                dgl[i_b, slot, i_h, k] = ln2 * T.exp2(gl_s[k]) * dgl_s[k]

    @T.prim_func
    def state_bwd(
        qg: T.Tensor((B, Tn, H, K), dtype),
        kg: T.Tensor((B, Tn, H, K), dtype),
        bg: T.Tensor((B, Tn, H, K), dtype),
        w: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, H, V), dtype),
        A_qk: T.Tensor((B, Tn, H, C), dtype),
        A_qb: T.Tensor((B, Tn, H, C), dtype),
        gl: T.Tensor((B, S, H, K), _ACC),
        h: T.Tensor((B, S, H, K, V), _ACC),
        v_new: T.Tensor((B, Tn, H, V), dtype),
        do: T.Tensor((B, Tn, H, V), dtype),
        dht: T.Tensor((Nd, H, K, V), _ACC),
        cu_seqlens: T.Tensor((Ncu,), "int32"),
        chunk_offsets: T.Tensor((Ncu,), "int32"),
        dqg: T.Tensor((B, Tn, H, K), dtype),
        dkg: T.Tensor((B, Tn, H, K), dtype),
        dbg: T.Tensor((B, Tn, H, K), dtype),
        dw: T.Tensor((B, Tn, H, K), dtype),
        du: T.Tensor((B, Tn, H, V), dtype),
        dv: T.Tensor((B, Tn, H, V), dtype),
        dA_qk: T.Tensor((B, Tn, H, C), dtype),
        dA_qb: T.Tensor((B, Tn, H, C), dtype),
        dgl: T.Tensor((B, S, H, K), _ACC),
        dh0: T.Tensor((N0, H, K, V), _ACC),
    ):
        with T.Kernel(H, Ncu - 1, threads=threads) as (i_h, i_n):
            # ---- buffers ----
            qg_s = T.alloc_shared((C, K), dtype)
            kg_s = T.alloc_shared((C, K), dtype)
            bg_s = T.alloc_shared((C, K), dtype)
            w_s = T.alloc_shared((C, K), dtype)
            # v (rows 0..C) and v_new (rows C..2C) stacked: one GEMM do·[v; v_new]ᵀ makes
            # both dA's; R - 2C zero rows pad it to a width every warp can take (C = 16)
            vv_s = T.alloc_shared((R, V), dtype)
            do_s = T.alloc_shared((C, V), dtype)
            Aqk_s = T.alloc_shared((C, C), dtype)
            Aqb_s = T.alloc_shared((C, C), dtype)
            gl_s = T.alloc_shared((K,), _ACC)
            dh_s = T.alloc_shared((K, V), dtype)  # dh at the chunk end, GEMM operand
            hb_s = T.alloc_shared((K, V), dtype)  # h at the chunk start, GEMM operand
            dvn_s = T.alloc_shared((C, V), dtype)

            dh = T.alloc_fragment((K, V), _ACC)  # carried gradient, fp32
            # h of the chunk being processed, one column block at a time
            h_f = T.alloc_fragment((K, VP), _ACC)
            if h_parts == 2:
                # pin h_f to dh's accumulator layout restricted to VP columns: left to inference,
                # a [K, VP] fragment fed from the [K, V] dh gets dh's whole layout and
                # reduce_sum then reads registers no loop wrote (non-finite dgl)
                T.annotate_layout({h_f: _column_block_layout(K, VP, threads)})
            dgl_f = T.alloc_fragment((K,), _ACC)
            dgl_s = T.alloc_shared((K,), _ACC)
            dvn_f = T.alloc_fragment((C, V), _ACC)
            dv_f = T.alloc_fragment((C, V), _ACC)
            dA_f = T.alloc_fragment((C, R), _ACC)  # [dA_qk | dA_qb | pad]
            dq_f = T.alloc_fragment((C, K), _ACC)
            dw_f = T.alloc_fragment((C, K), _ACC)
            dk_f = T.alloc_fragment((C, K), _ACC)
            db_f = T.alloc_fragment((C, K), _ACC)

            i_b = 0  # one list of sequences (a rect batch arrives flattened)
            bos = cu_seqlens[i_n]
            eos = cu_seqlens[i_n + 1]
            s0 = chunk_offsets[i_n]
            nc = T.ceildiv(eos - bos, C)

            if Nd > 0:
                T.copy(dht[i_n, i_h, :, :], dh)
            else:
                T.clear(dh)

            # ---- prologue: the last (possibly partial) chunk, predicated loads ----
            if nc > 0:
                tl0 = bos + (nc - 1) * C
                ll = eos - tl0
                load_rows(qg, qg_s, i_b, tl0, i_h, ll)
                load_rows(kg, kg_s, i_b, tl0, i_h, ll)
                load_rows(bg, bg_s, i_b, tl0, i_h, ll)
                load_rows(w, w_s, i_b, tl0, i_h, ll)
                for i, j in T.Parallel(R, V):
                    vv_s[i, j] = T.if_then_else(
                        i < C,
                        T.if_then_else(i < ll, v[i_b, tl0 + i, i_h, j], T.Cast(dtype, 0)),
                        T.if_then_else(
                            i < 2 * C and i - C < ll,
                            v_new[i_b, tl0 + i - C, i_h, j],
                            T.Cast(dtype, 0),
                        ),
                    )
                load_rows(do, do_s, i_b, tl0, i_h, ll)
                load_rows(A_qk, Aqk_s, i_b, tl0, i_h, ll)
                load_rows(A_qb, Aqb_s, i_b, tl0, i_h, ll)
                for k in T.Parallel(K):
                    gl_s[k] = gl[i_b, s0 + nc - 1, i_h, k]

            for it in T.serial(nc):
                c = nc - 1 - it
                t0 = bos + c * C
                ln = T.min(eos - t0, C)
                slot = s0 + c
                tp = t0 - C  # start of the chunk to prefetch

                # batches A and B of the previous iteration (or the prologue) have landed
                T.ptx_wait_group(_NC)
                T.sync_threads()
                # h of this chunk: loads issued now, first used after two (four) GEMMs
                T.copy(h[i_b, slot, i_h, :, 0:VP], h_f)
                for i, j in T.Parallel(C, C):
                    Aqk_s[i, j] = T.if_then_else(j <= i, Aqk_s[i, j], T.Cast(dtype, 0))
                    Aqb_s[i, j] = T.if_then_else(j <= i, Aqb_s[i, j], T.Cast(dtype, 0))
                for k, j in T.Parallel(K, V):
                    dh_s[k, j] = T.Cast(dtype, dh[k, j])
                T.sync_threads()

                # ---- dvn (= du) and dv ----
                T.gemm(Aqb_s, do_s, dvn_f, transpose_A=True, clear_accum=True)
                T.gemm(bg_s, dh_s, dvn_f)
                store_rows(dvn_f, du, i_b, t0, i_h, ln)
                T.copy(dvn_f, dvn_s)
                T.gemm(Aqk_s, do_s, dv_f, transpose_A=True, clear_accum=True)
                T.gemm(kg_s, dh_s, dv_f)
                store_rows(dv_f, dv, i_b, t0, i_h, ln)
                if h_parts == 2:
                    use_h(h_f, 0, hb_s, dh, dgl_f, dgl_s, gl_s, dgl, i_b, slot, i_h)
                    T.copy(h[i_b, slot, i_h, :, VP:V], h_f)

                # ---- prefetch batch A ----
                if c > 0:
                    T.sync_threads()
                    T.async_copy(bg[i_b, tp : tp + C, i_h, :], bg_s)
                    T.async_copy(A_qb[i_b, tp : tp + C, i_h, :], Aqb_s, coalesced_width=8)
                    T.async_copy(kg[i_b, tp : tp + C, i_h, :], kg_s)
                    T.async_copy(A_qk[i_b, tp : tp + C, i_h, :], Aqk_s, coalesced_width=8)

                # ---- dA_qk, dA_qb (waiting for v and v_new of batch C) ----
                if c > 0:
                    T.ptx_wait_group(_NC - 2 + _NA)
                else:
                    T.ptx_wait_group(_NC - 2)
                T.sync_threads()
                T.gemm(do_s, vv_s, dA_f, transpose_B=True, clear_accum=True)
                store_tril(dA_f, 0, dA_qk, i_b, t0, i_h, ln)
                store_tril(dA_f, C, dA_qb, i_b, t0, i_h, ln)

                # ---- dgl = ln2 2^gl rowsum(h ⊙ dh) in fp32; h to shared; dh *= 2^gl ----
                use_h(h_f, h_parts - 1, hb_s, dh, dgl_f, dgl_s, gl_s, dgl, i_b, slot, i_h)
                for k, j in T.Parallel(K, V):
                    dh[k, j] = dh[k, j] * T.exp2(gl_s[k])
                T.sync_threads()

                # ---- dqg; dh += qgᵀ·do ----
                T.gemm(do_s, hb_s, dq_f, transpose_B=True, clear_accum=True)
                store_rows(dq_f, dqg, i_b, t0, i_h, ln)
                T.gemm(qg_s, do_s, dh, transpose_A=True, policy=rows)

                # ---- prefetch batch B ----
                if c > 0:
                    T.sync_threads()
                    T.async_copy(qg[i_b, tp : tp + C, i_h, :], qg_s)
                    T.async_copy(do[i_b, tp : tp + C, i_h, :], do_s)
                    T.async_copy(gl[i_b, slot - 1, i_h, :], gl_s)

                # ---- dkg, dbg, dw; dh += wᵀ·dvn (waiting for w of batch C) ----
                T.gemm(vv_s[0:C, :], dh_s, dk_f, transpose_B=True, clear_accum=True)
                store_rows(dk_f, dkg, i_b, t0, i_h, ln)
                T.gemm(vv_s[C : 2 * C, :], dh_s, db_f, transpose_B=True, clear_accum=True)
                store_rows(db_f, dbg, i_b, t0, i_h, ln)
                T.gemm(dvn_s, hb_s, dw_f, transpose_B=True, clear_accum=True)
                store_rows(dw_f, dw, i_b, t0, i_h, ln)
                if c > 0:
                    T.ptx_wait_group(_NC - 3 + _NA + _NB)
                else:
                    T.ptx_wait_group(_NC - 3)
                T.sync_threads()
                T.gemm(w_s, dvn_s, dh, transpose_A=True, policy=rows)

                # ---- prefetch batch C ----
                if c > 0:
                    T.sync_threads()
                    T.async_copy(v[i_b, tp : tp + C, i_h, :], vv_s[0:C, :])
                    T.async_copy(v_new[i_b, tp : tp + C, i_h, :], vv_s[C : 2 * C, :])
                    T.async_copy(w[i_b, tp : tp + C, i_h, :], w_s)

            if N0 > 0:
                T.copy(dh, dh0[i_n, i_h, :, :])
            # unused trailing chunk slots of dgl (varlen): zeros, one slot per CTA
            zs = chunk_offsets[Ncu - 1] + i_n
            if zs < S:
                for k in T.Parallel(K):
                    dgl[0, zs, i_h, k] = T.float32(0)

    return state_bwd


def variants():
    """Every config the dispatch builds (and the CI compiles): C x K=V x dtype."""
    for C, K, dt in itertools.product(CHUNK_SIZES, HEAD_DIMS, DTYPES):
        yield dict(C=C, K=K, V=K, dtype=dt)


def ref_program(*args, **kwargs):
    """The contract: ``torch_dplr.ops.state.chunk_state_bwd_reference`` (same argument order
    up to ``dht``, then ``initial_state, cu_seqlens, chunk_size, use_initial_state, use_dht``);
    the math is ``torch_dplr.reference.state.state_bwd``."""
    from torch_dplr.ops.state import chunk_state_bwd_reference

    return chunk_state_bwd_reference(*args, **kwargs)
