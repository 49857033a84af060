"""The chunked forward in one sweep: ``o``, the final state and (for training) the state at
every chunk start, straight from q, k, v, a, b, gk.

One program per (value block, head, sequence) walks the sequence (from its end with
``REVERSE``) in tiles of ``BT`` rows with its fp32 state columns ``[K, BV]`` in registers
(:mod:`csrc_triton.dplr_tile` has the tile's math); at the start of every chunk of
``C = BT · TILES_PER_CHUNK`` rows it writes them when ``STORE_H``.  Value blocks are exact (o,
v_new and the state are column-separable) but each recomputes the tile's key-side terms and
reads q, k, a, b, gk again: they pay only where sequences x heads leave SMs idle.  Measured
(``python -m benchmarks.sweep_kernels --shapes design,small,long --block-v 64,32,16 --modes
fwd``, H200, chunk 64): B2 T4096 H8 1.37 / 1.15 / 1.55 ms, B1 T65536 H32 21.96 / 17.70 /
24.74 ms, B8 T4096 H32 1.71 / 2.92 / 7.47 ms for BV 64 / 32 / 16.  The launch default is one
block (``block_v=0``).

HBM traffic (bytes per token and head, bf16 data, fp32 gates, D = K = V)::

    read   q k v a b: 5 · 2D     gk: 4D
    write  o: 2D                 states: 4·D·D / C   (STORE_H; 4D at C = D = 64)

At B8 T4096 H32 D64, chunk 64: 939 MB read, 134 MB of o and 268 MB of states written (1.34 GB);
nothing else crosses HBM.  With ``V / BV`` value blocks the key-side reads (q k a b: 8D, gk: 4D)
repeat ``V / BV`` times.  The no-grad forward is the same kernel with ``STORE_H`` off.

Schemes (``MODE``, :mod:`csrc_triton.dplr_tile`): a call whose gates carry a declared bound
runs ``FAST`` (centred products only), which counts per (sequence, head) the tiles whose gates
broke the bound into ``flags``, then ``EXACT_FLAGGED``, whose programs redo exactly those
(sequence, head) pairs (the others return at once): a broken promise costs time, never
accuracy, and needs no host sync.  Calls without a bound run ``EXACT_ALL``.

Signature (caller-allocated outputs; token tensors flattened to one sequence list)::

    chunk_fwd(q, k, v, a, b, gk, h0, cu_seqlens, chunk_offsets, o, ht, h, flags, scale, ...)

q, k, a, b [1, T, H, K]; v, o [1, T, H, V] (bf16 / fp16); gk [1, T, H, K] (fp32 or the data
dtype); h0 [N, H, K, V] fp32 (read when ``USE_H0``); cu_seqlens, chunk_offsets int32 [N+1]
(``torch_dplr.ops.varlen``); ht [N, H, K, V] fp32; h [1, slots, H, K, V] fp32 (chunk slot
``chunk_offsets[n] + c``; written when ``STORE_H``); flags int32 [N, H] (written by ``FAST``,
read by ``EXACT_FLAGGED``, unused by ``EXACT_ALL``).
"""
import triton
import triton.language as tl

from ._common import round_to
from .dplr_tile import (EXACT_ALL, EXACT_FLAGGED, FAST, centred_fits, keep_chunk_state,
                        load_tile, sequence_of, tile_forward_terms, tile_rows, tile_state_step,
                        walk_start)

BT_DEFAULT = 16


def grid(num_heads: int, num_seqs: int, value_blocks: int = 1):
    return (value_blocks, num_heads, num_seqs)


@triton.jit
def chunk_fwd_kernel(q, k, v, a, b, gk, h0, cu_seqlens, chunk_offsets, o, ht, h_out, flags,
                     scale, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                     BT: tl.constexpr, TILES_PER_CHUNK: tl.constexpr, USE_H0: tl.constexpr,
                     STORE_H: tl.constexpr, MODE: tl.constexpr, REVERSE: tl.constexpr,
                     STATE_SPLIT: tl.constexpr):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.program_id(2)
    flag = flags + i_n * H + i_h
    if MODE == EXACT_FLAGGED:
        run = tl.load(flag) != 0
    else:
        run = True
    if run:
        misfits = _sweep(q, k, v, a, b, gk, h0, cu_seqlens, chunk_offsets, o, ht, h_out,
                         scale, i_v * BV, i_h, i_n, H, K, V, BV, BT, TILES_PER_CHUNK, USE_H0,
                         STORE_H, MODE != FAST, REVERSE, STATE_SPLIT)
        if MODE == FAST:
            # every value block of a (sequence, head) sees the same gates: the same count
            tl.store(flag, misfits)


@triton.jit
def _sweep(q, k, v, a, b, gk, h0, cu_seqlens, chunk_offsets, o, ht, h_out, scale, v0, i_h, i_n,
           H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
           TILES_PER_CHUNK: tl.constexpr, USE_H0: tl.constexpr, STORE_H: tl.constexpr,
           EXACT: tl.constexpr, REVERSE: tl.constexpr, STATE_SPLIT: tl.constexpr):
    """One (value block, head, sequence)'s walk; returns how many tiles the centred scheme
    could not take."""
    dtype: tl.constexpr = o.dtype.element_ty
    bos, eos, slot0 = sequence_of(cu_seqlens, chunk_offsets, i_n)
    cv = v0 + tl.arange(0, BV)
    state_offsets, seq_state, h = walk_start(h0, i_n, i_h, H, K, V, v0, BV, USE_H0)
    misfits = 0
    for t in range(tl.cdiv(eos - bos, BT)):
        if STORE_H:
            keep_chunk_state(h_out, h, t, slot0, i_h, H, K, V, state_offsets, TILES_PER_CHUNK)
        tok, valid = tile_rows(bos, eos, t, BT, REVERSE)
        q_t, k_t, a_t, b_t, g_t, v_t = load_tile(q, k, v, a, b, gk, tok, valid, i_h, H, K, V,
                                                 v0, BV)
        (qg, kg, bg, w, u, A_qk, A_qb, Gl, _Ainv, _A_ak, _A_ab, _ag, _G, _Ge,
         centre) = tile_forward_terms(q_t, k_t, a_t, b_t, v_t, g_t, scale, dtype, EXACT, BT)
        misfits += tl.where(centred_fits(Gl, centre), 0, 1)
        o_t, _v_new, h = tile_state_step(h, qg, kg, bg, w, u, A_qk, A_qb, Gl, v_t, valid, dtype,
                                         STATE_SPLIT)
        row_v = (tok[:, None] * H + i_h) * V + cv[None, :]
        tl.store(o + row_v, round_to(o_t, dtype), mask=valid[:, None])
    tl.store(ht + seq_state + state_offsets, h)
    return misfits


def launch(q, k, v, a, b, gk, h0, cu_seqlens, chunk_offsets, o, ht, h, flags, scale: float,
           chunk_size: int, use_h0: bool, store_h: bool, bounded: bool, reverse: bool = False,
           num_warps: int = 4, block_v: int = 0, num_stages: int = 1, state_split: bool = True):
    """Run the forward on flattened ``[1, T, H, D]`` tensors: ``FAST`` then ``EXACT_FLAGGED``
    for a call with a declared gate bound (``bounded``), ``EXACT_ALL`` otherwise.  ``flags``
    (int32 ``[N, H]``) is left as the backward must read it.  ``block_v`` (0: all of V) splits
    the value columns over programs: each recomputes the tile's key-side terms, and more
    programs fill the SMs when sequences x heads are few.  ``state_split`` False rounds the
    state and v_new once to the data dtype in their products instead of taking them as hi/lo
    pairs (:func:`csrc_triton.dplr_tile.tile_state_step`): fewer products, a less accurate
    state."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    BV = block_v or V
    if V % BV:
        raise ValueError(f"block_v={block_v} must divide the value head dim {V}")
    modes = (FAST.value, EXACT_FLAGGED.value) if bounded else (EXACT_ALL.value,)
    for mode in modes:
        chunk_fwd_kernel[grid(H, N, V // BV)](q, k, v, a, b, gk, h0, cu_seqlens, chunk_offsets,
                                              o, ht, h, flags, scale, H=H, K=K, V=V, BV=BV,
                                              BT=BT_DEFAULT,
                                              TILES_PER_CHUNK=chunk_size // BT_DEFAULT,
                                              USE_H0=use_h0, STORE_H=store_h, MODE=mode,
                                              REVERSE=reverse, STATE_SPLIT=state_split,
                                              num_warps=num_warps, num_stages=num_stages)
