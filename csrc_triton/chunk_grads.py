"""The backward split in three: every tile's terms in parallel, the walk of the state gradient
alone, then every chunk's gradients in parallel.

``chunk_bwd`` carries the state gradient ``dh`` from tile to tile inside one program per
(sequence, head) and differentiates each whole tile in that serial chain.  Only ``dh`` needs
the chain (``dv_new = A_qbᵀ do + bg dh``, ``dh_in = 2^Gl dh + qgᵀ do + wᵀ dv_new``,
:func:`csrc_triton.dplr_tile_bwd.state_grad_step`); given the state entering a chunk (the
forward keeps it) and the gradient of the state leaving it, every gradient of the chunk is
chunk-local.  So:

1. :mod:`csrc_triton.tile_terms`: w, A_qb of every tile (u, A_qk come along);
2. ``grad_walk_kernel``, one program per (value block, head, sequence), from the last tile:
   the state-gradient step per tile, writing the gradient of the state leaving every chunk
   (``dh_chunks``, fp32, the layout of the kept states) and ``dh0``;
3. ``chunk_grads_kernel``, one program per (chunk slot, head): the chunk's tiles from the
   last, each from its start state (recomputed from the kept one, a forward step per earlier
   tile of the chunk) and the carried ``dh``
   (:func:`csrc_triton.dplr_tile_bwd.tile_backward`), writing dq, dk, dv, da, db, dgk.

The same terms at the same rounding points as ``chunk_bwd``: the same gradients, bit for bit
under the interpreter (``tests/test_triton_interpret.py``).

HBM traffic (bytes per token and head, bf16 data, fp32 gates, D = K = V; states 4·D·D/C)::

    tile terms   read  q k v a b: 5 · 2D   gk: 4D        write w u: 2 · 2D   A_qk A_qb: 2 · 32
    grad walk    read  q b do w: 4 · 2D   gk: 4D   A_qb: 32      write dh_chunks: 4·D·D/C
    chunk grads  read  q k v a b do: 6 · 2D   gk: 4D   states, dh_chunks: 2 · 4·D·D/C
                 write dq dk dv da db: 5 · 2D   dgk: 4D

At B8 T4096 H32 D64, chunk 64: 1.28 GB, 1.11 GB and 2.55 GB, 4.9 GB in all against the
2.29 GB the backward must move: the tile terms and the chunk-end gradients are the excess.

Schemes: the tile terms as in :mod:`csrc_triton.tile_terms`; the chunk gradients, with a
declared bound, ``FAST`` for chunks whose tiles all took centred products (``tile_flags``
clear) and ``EXACT_FLAGGED`` for the others, ``EXACT_ALL`` without a bound.
"""
import triton
import triton.language as tl

from . import chunk_terms
from .dplr_tile import (EXACT_ALL, EXACT_FLAGGED, FAST, LOG2E, first_column,
                        gate_sums, gated_operands, load_rows, load_stored, sequence_of, tile_at,
                        tile_forward_step, walk_start)
from .dplr_tile_bwd import state_grad_step, tile_backward_stored

BT = 16


@triton.jit
def grad_walk_kernel(q, b, gk, w, A_qb, do, dht, cu_seqlens, chunk_offsets, dh_chunks, dh0,
                     scale, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                     BT: tl.constexpr, TILES_PER_CHUNK: tl.constexpr, USE_DHT: tl.constexpr,
                     WRITE_DH0: tl.constexpr, STATE_SPLIT: tl.constexpr):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.program_id(2)
    dtype: tl.constexpr = do.dtype.element_ty
    v0 = first_column(i_v, BV, V)
    bos, eos, slot0 = sequence_of(cu_seqlens, chunk_offsets, i_n)
    state_offsets, seq_state, dh = walk_start(dht, i_n, i_h, H, K, V, v0, BV, USE_DHT)
    n_tiles = tl.cdiv(eos - bos, BT)
    for tr in range(n_tiles):
        t = n_tiles - 1 - tr
        # arriving at a chunk's last tile, dh is the gradient of the state leaving the chunk
        if (t % TILES_PER_CHUNK == TILES_PER_CHUNK - 1) | (tr == 0):
            slot = slot0 + t // TILES_PER_CHUNK
            tl.store(dh_chunks + (slot * H + i_h) * K * V + state_offsets, dh)
        first, rows, valid = tile_at(bos, eos, t, BT)
        at = first * H  # the tile's first (token, head 0) row
        G, _Ge, Gl, _centre = gate_sums(load_rows(gk + at * K, rows, valid, i_h, H, K, 0, K)
                                        * LOG2E, BT)
        b_t = load_rows(b + at * K, rows, valid, i_h, H, K, 0, K)
        qg, _bg, bg = gated_operands(load_rows(q + at * K, rows, valid, i_h, H, K, 0, K), b_t,
                                     b_t, G, Gl, scale, dtype)
        w_t = load_stored(w + at * K, rows, valid, i_h, H, K, 0, K)
        A_qb_t = load_stored(A_qb + at * BT, rows, valid, i_h, H, BT, 0, BT)
        do_t = load_stored(do + at * V, rows, valid, i_h, H, V, v0, BV)
        _dv_new, dh = state_grad_step(dh, qg, bg, w_t, A_qb_t, do_t, Gl, valid, dtype,
                                      STATE_SPLIT)
    if WRITE_DH0:
        tl.store(dh0 + seq_state + state_offsets, dh)


@triton.jit
def chunk_grads_kernel(q, k, v, a, b, gk, h_saved, dh_chunks, do, chunk_start, chunk_len,
                       tile_flags, dq, dk, dv, da, db, dgk, scale, H, K: tl.constexpr,
                       V: tl.constexpr, BT: tl.constexpr, TILES_PER_CHUNK: tl.constexpr,
                       MODE: tl.constexpr, STATE_SPLIT: tl.constexpr):
    slot = tl.program_id(0)
    i_h = tl.program_id(1)
    length = tl.load(chunk_len + slot)
    flagged = tl.sum(tl.load(tile_flags + (slot * TILES_PER_CHUNK
                                           + tl.arange(0, TILES_PER_CHUNK)) * H + i_h), axis=0)
    if MODE == FAST:
        run = (length > 0) & (flagged == 0)
    elif MODE == EXACT_FLAGGED:
        run = (length > 0) & (flagged != 0)
    else:
        run = length > 0
    if run:
        dtype: tl.constexpr = dq.dtype.element_ty
        EXACT: tl.constexpr = MODE != FAST
        # every pointer advanced to the chunk's first token: the tiles' offsets stay int32
        # (an int64 offset tile takes two registers an element, and this kernel spills)
        start = tl.load(chunk_start + slot).to(tl.int64)
        at_k = start * H * K
        at_v = start * H * V
        q, k, a, b, gk = q + at_k, k + at_k, a + at_k, b + at_k, gk + at_k
        dq, dk, da, db, dgk = dq + at_k, dk + at_k, da + at_k, db + at_k, dgk + at_k
        v, do, dv = v + at_v, do + at_v, dv + at_v
        state_offsets = tl.arange(0, K)[:, None] * V + tl.arange(0, V)[None, :]
        # int64: slots x H x K x V passes 2^31 from about 262k tokens at chunk 16, H 32, D 64
        chunk_state = (slot.to(tl.int64) * H + i_h) * K * V + state_offsets
        h_chunk = tl.load(h_saved + chunk_state)
        dh = tl.load(dh_chunks + chunk_state)
        n_tiles = tl.cdiv(length, BT)
        rows = tl.arange(0, BT)
        for tr in range(n_tiles):
            t = n_tiles - 1 - tr
            h = h_chunk
            for t_before in range(t):  # the state entering tile t
                tok = t_before * BT + rows
                h = tile_forward_step(q, k, v, a, b, gk, tok, tok < length, i_h, H, K, V, h,
                                      scale, dtype, EXACT, BT, STATE_SPLIT)
            tok = t * BT + rows
            dh = tile_backward_stored(q, k, v, a, b, gk, do, tok, tok < length, i_h, H, K, V,
                                      h, dh, dq, dk, dv, da, db, dgk, scale, dtype, EXACT, BT,
                                      STATE_SPLIT)


def launch_walk(q, b, gk, w, A_qb, do, dht, cu_seqlens, chunk_offsets, dh_chunks, dh0,
                scale: float, chunk_size: int, use_dht: bool, write_dh0: bool,
                num_warps: int = 4, block_v: int = 0, num_stages: int = 1,
                state_split: bool = True, walk_rows: int = BT):
    """The state-gradient walk: ``dh_chunks`` (the kept states' layout) and ``dh0``;
    ``block_v`` (0: all of V) splits the value columns over programs; ``walk_rows`` the rows
    of a step, those of the terms ``w``, ``A_qb`` (16: :mod:`csrc_triton.tile_terms`, 64:
    :mod:`csrc_triton.chunk_terms`)."""
    H, K, V = q.shape[2], q.shape[3], do.shape[3]
    N = cu_seqlens.shape[0] - 1
    BV = block_v or V
    if V % BV:
        raise ValueError(f"block_v={block_v} must divide the value head dim {V}")
    grad_walk_kernel[(V // BV, H, N)](
        q, b, gk, w, A_qb, do, dht, cu_seqlens, chunk_offsets, dh_chunks, dh0, scale, H=H, K=K,
        V=V, BV=BV, BT=walk_rows, TILES_PER_CHUNK=chunk_size // walk_rows, USE_DHT=use_dht,
        WRITE_DH0=write_dh0, STATE_SPLIT=state_split, num_warps=num_warps,
        num_stages=num_stages)


def launch_grads(q, k, v, a, b, gk, h, dh_chunks, do, chunk_start, chunk_len, tile_flags, dq,
                 dk, dv, da, db, dgk, scale: float, chunk_size: int, bounded: bool,
                 num_warps: int = 4, num_stages: int = 1, state_split: bool = True):
    """Every chunk's gradients, in the tile terms' schemes (their ``tile_flags``)."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    modes = (FAST.value, EXACT_FLAGGED.value) if bounded else (EXACT_ALL.value,)
    for mode in modes:
        chunk_grads_kernel[(chunk_start.shape[0], H)](
            q, k, v, a, b, gk, h, dh_chunks, do, chunk_start, chunk_len, tile_flags, dq, dk, dv,
            da, db, dgk, scale, H=H, K=K, V=V, BT=BT, TILES_PER_CHUNK=chunk_size // BT,
            MODE=mode, STATE_SPLIT=state_split, num_warps=num_warps, num_stages=num_stages)


def split_backward(q, k, v, a, b, gk, h, do, dht, tables, dq, dk, dv, da, db, dgk, dh0,
                   scale: float, chunk_size: int, use_dht: bool, write_dh0: bool,
                   bounded: bool, num_warps: int = 4, block_v: int = 0, num_stages: int = 1,
                   state_split: bool = True, terms_warps: int = 0, walk_rows: int = BT):
    """Every gradient from the forward's kept states ``h`` (the chunk-start states at
    ``chunk_size``, the same ``state_split``), as ``chunk_bwd.launch`` (forward walks);
    ``tables``: the call's ``KernelTables`` at ``chunk_size``; buffers allocated here, freed
    when this returns; ``terms_warps`` (0: ``num_warps``) the terms kernel's warps;
    ``walk_rows`` 16 (every tile's terms, a walk step per tile) or 64 at chunk 64 (every
    chunk's terms, :mod:`csrc_triton.chunk_terms`, a step per chunk): the chunk gradients take
    16-row tiles either way."""
    w, _u, _A_qk, A_qb, tile_flags = chunk_terms.compute_for_walk(
        q, k, v, a, b, gk, tables, scale, chunk_size, bounded, walk_rows,
        num_warps=terms_warps or num_warps)
    dh_chunks = h.new_empty(h.shape)
    launch_walk(q, b, gk, w, A_qb, do, dht, tables.cu_seqlens, tables.chunk_offsets, dh_chunks,
                dh0, scale, chunk_size, use_dht, write_dh0, num_warps=num_warps,
                block_v=block_v, num_stages=num_stages, state_split=state_split,
                walk_rows=walk_rows)
    launch_grads(q, k, v, a, b, gk, h, dh_chunks, do, tables.chunk_start, tables.chunk_len,
                 tile_flags, dq, dk, dv, da, db, dgk, scale, chunk_size, bounded,
                 num_warps=num_warps, num_stages=num_stages, state_split=state_split)
