"""The serial half of the split forward: the state step of every tile, in order.

One program per (value block, head, sequence) walks the sequence in 16-row tiles with its fp32
state columns ``[K, BV]`` in registers, as ``csrc_triton.chunk_fwd`` does, but the tile's
state-free terms come precomputed (:mod:`csrc_triton.tile_terms`: ``w``, ``u``, ``A_qk``,
``A_qb``), so each step is only ``v_new = u + w h``, ``o = qg h + A_qk v + A_qb v_new`` and
``h' = 2^Gl h + kgᵀ v + bgᵀ v_new``.  ``qg``, ``kg``, ``bg`` and the decay are formed here from
q, k, b and the gates (:func:`csrc_triton.dplr_tile.gated_operands`, the rounding of the
one-sweep kernel): re-reading q, k, b, gk costs less than writing and reading them back.  At
the start of every chunk of ``C`` rows it writes the state when ``STORE_H``.

HBM traffic (bytes per token and head, bf16 data, fp32 gates, D = K = V, one value block)::

    read   q k b v w u: 6 · 2D     gk: 4D     A_qk A_qb: 2 · 2 · 16
    write  o: 2D                   states: 4·D·D / C   (STORE_H)

At B8 T4096 H32 D64, chunk 64: 1141 MB read, 134 MB of o and 268 MB of states written.

``flags`` (int32 ``[N, H]``) receives per (sequence, head) the number of tiles whose gates
broke the centred scheme's range, as ``chunk_fwd``'s ``FAST`` pass writes it, so that
``csrc_triton.chunk_bwd`` can run after this forward.

Measured (``python -m benchmarks.sweep_kernels --shapes design,small --stages 1,2,3 --modes
split``, H200, 4 warps, one value block): 1.30 / 1.05 / 0.96 ms at B8 T4096 H32 D64 for
``num_stages`` 1 / 2 / 3 (the pipeliner prefetches the next tile's loads), 1.09 / 0.80 /
0.71 ms at B2 T4096 H8: 256 serial 16-row steps cost more than the forward's target on their
own (``docs/training_dataflow.md``).

Signature (caller-allocated outputs; token tensors flattened to one sequence list)::

    state_sweep(q, k, v, b, gk, w, u, A_qk, A_qb, h0, cu_seqlens, chunk_offsets, o, ht, h,
                flags, scale)

Shapes as in ``chunk_fwd`` and ``tile_terms``.
"""
import triton
import triton.language as tl

from . import chunk_terms
from ._common import round_to
from .dplr_tile import (LOG2E, centred_fits, first_column, gate_sums, gated_operands,
                        keep_chunk_state, load_rows, load_stored, sequence_of, tile_at,
                        tile_state_step, walk_start)

BT = 16


def grid(num_heads: int, num_seqs: int, value_blocks: int = 1):
    return (value_blocks, num_heads, num_seqs)


@triton.jit
def state_sweep_kernel(q, k, v, b, gk, w, u, A_qk, A_qb, block_flags, h0, cu_seqlens,
                       chunk_offsets, o, ht, h_out, flags, scale, H, K: tl.constexpr,
                       V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                       TILES_PER_CHUNK: tl.constexpr, USE_H0: tl.constexpr,
                       STORE_H: tl.constexpr, STATE_SPLIT: tl.constexpr):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.program_id(2)
    dtype: tl.constexpr = o.dtype.element_ty
    v0 = first_column(i_v, BV, V)
    bos, eos, slot0 = sequence_of(cu_seqlens, chunk_offsets, i_n)
    cv = v0 + tl.arange(0, BV)
    state_offsets, seq_state, h = walk_start(h0, i_n, i_h, H, K, V, v0, BV, USE_H0)
    misfits = 0
    for t in range(tl.cdiv(eos - bos, BT)):
        if STORE_H:
            keep_chunk_state(h_out, h, t, slot0, i_h, H, K, V, state_offsets, TILES_PER_CHUNK)
        first, rows, valid = tile_at(bos, eos, t, BT)
        at = first * H  # the tile's first (token, head 0) row
        g_t = load_rows(gk + at * K, rows, valid, i_h, H, K, 0, K) * LOG2E
        G, _Ge, Gl, centre = gate_sums(g_t, BT)
        if BT == 16:
            misfits += tl.where(centred_fits(Gl, centre), 0, 1)
        else:  # a chunk's 16-row blocks, as the chunk terms flagged them
            blocks = (slot0 + t) * (BT // 16) + tl.arange(0, BT // 16)
            misfits += tl.sum(tl.load(block_flags + blocks * H + i_h), axis=0)
        qg, kg, bg = gated_operands(load_rows(q + at * K, rows, valid, i_h, H, K, 0, K),
                                    load_rows(k + at * K, rows, valid, i_h, H, K, 0, K),
                                    load_rows(b + at * K, rows, valid, i_h, H, K, 0, K), G, Gl,
                                    scale, dtype)
        w_t = load_stored(w + at * K, rows, valid, i_h, H, K, 0, K)
        u_t = load_stored(u + at * V, rows, valid, i_h, H, V, v0, BV)
        A_qk_t = load_stored(A_qk + at * BT, rows, valid, i_h, H, BT, 0, BT)
        A_qb_t = load_stored(A_qb + at * BT, rows, valid, i_h, H, BT, 0, BT)
        v_t = load_stored(v + at * V, rows, valid, i_h, H, V, v0, BV)
        o_t, _v_new, h = tile_state_step(h, qg, kg, bg, w_t, u_t, A_qk_t, A_qb_t, Gl, v_t,
                                         valid, dtype, STATE_SPLIT)
        row_v = (rows[:, None] * H + i_h) * V + cv[None, :]
        tl.store(o + at * V + row_v, round_to(o_t, dtype), mask=valid[:, None])
    tl.store(ht + seq_state + state_offsets, h)
    if i_v == 0:
        tl.store(flags + i_n * H + i_h, misfits)


def launch(q, k, v, b, gk, w, u, A_qk, A_qb, h0, cu_seqlens, chunk_offsets, o, ht, h, flags,
           scale: float, chunk_size: int, use_h0: bool, store_h: bool, num_warps: int = 4,
           block_v: int = 0, num_stages: int = 1, state_split: bool = True,
           block_flags=None):
    """The state walk over precomputed terms: 16-row tiles (:mod:`csrc_triton.tile_terms`),
    or with ``block_flags`` (:mod:`csrc_triton.chunk_terms`' flags) one 64-row step per chunk
    of 64, ``flags`` then counting the chunk terms' flagged blocks; ``block_v`` (0: all of V)
    splits the value columns over programs (exact: o, v_new and the state are
    column-separable); ``state_split`` as in ``chunk_fwd.launch``."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    BV = block_v or V
    if V % BV:
        raise ValueError(f"block_v={block_v} must divide the value head dim {V}")
    rows = BT if block_flags is None else chunk_size
    state_sweep_kernel[grid(H, N, V // BV)](
        q, k, v, b, gk, w, u, A_qk, A_qb, flags if block_flags is None else block_flags, h0,
        cu_seqlens, chunk_offsets, o, ht, h, flags, scale, H=H, K=K, V=V, BV=BV, BT=rows,
        TILES_PER_CHUNK=chunk_size // rows, USE_H0=use_h0, STORE_H=store_h,
        STATE_SPLIT=state_split, num_warps=num_warps, num_stages=num_stages)


def split_forward(q, k, v, a, b, gk, h0, tables, o, ht, h, flags, scale: float, chunk_size: int,
                  use_h0: bool, store_h: bool, bounded: bool, num_warps: int = 4,
                  block_v: int = 0, num_stages: int = 1, state_split: bool = True,
                  terms_warps: int = 0, walk_rows: int = 16):
    """The forward of ``chunk_fwd.launch`` (forward walk) as the two halves: the terms in
    parallel, into buffers allocated here (freed when this returns), then the state walk.
    ``walk_rows`` 16: every 16-row tile's terms (:mod:`csrc_triton.tile_terms`) and a step per
    tile; 64 (chunk 64 only): every chunk's terms (:mod:`csrc_triton.chunk_terms`) and a step
    per chunk.  ``tables``: the call's ``KernelTables`` at ``chunk_size``; ``terms_warps``
    (0: ``num_warps``) the terms kernel's warps."""
    w, u, A_qk, A_qb, block_flags = chunk_terms.compute_for_walk(
        q, k, v, a, b, gk, tables, scale, chunk_size, bounded, walk_rows,
        num_warps=terms_warps or num_warps)
    if walk_rows == BT:  # a 16-row walk checks its tiles itself
        block_flags = None
    launch(q, k, v, b, gk, w, u, A_qk, A_qb, h0, tables.cu_seqlens, tables.chunk_offsets, o, ht,
           h, flags, scale, chunk_size, use_h0, store_h, num_warps=num_warps, block_v=block_v,
           num_stages=num_stages, state_split=state_split, block_flags=block_flags)
