"""The state-free terms of every tile at once: the parallel half of the split forward.

One program per (16-row tile, head) computes the tile's gate sums, its four ``A`` matrices,
``(I - A_ab)^-1``, ``w`` and ``u`` (:func:`csrc_triton.dplr_tile.tile_forward_terms`) and
writes, in the data dtype, what the state sweep (:mod:`csrc_triton.state_sweep`) cannot form
cheaply from the inputs: ``w``, ``u``, ``A_qk`` and ``A_qb``.  These are the values the
one-sweep forward rounds to the data dtype anyway, so splitting changes no result.  Nothing
here depends on the state, so the grid covers every tile of every sequence and head: the work
the one-sweep kernel serialises per (sequence, head) runs at full occupancy.

Tiles are addressed through the chunk tables (``torch_dplr.ops.varlen``): tile ``j`` of chunk
slot ``s`` starts at ``chunk_start[s] + 16 j``; a slot past the last real chunk, or a tile
past its chunk's end, does nothing.

HBM traffic (bytes per token and head, bf16 data, fp32 gates, D = K = V)::

    read   q k a b v: 5 · 2D     gk: 4D
    write  w u: 2 · 2D           A_qk A_qb: 2 · 2 · 16

At B8 T4096 H32 D64: 939 MB read, 336 MB written.

Schemes (:mod:`csrc_triton.dplr_tile`): with a declared bound ``FAST`` takes centred products
and marks in ``tile_flags`` the tiles whose gates do not allow them, then ``EXACT_FLAGGED``
redoes exactly those tiles with pairwise exponents (the others return at once); ``EXACT_ALL``
picks the scheme per tile.  No host sync either way.

Measured (``python -m benchmarks.sweep_kernels --shapes design,small --warps 1,2,4,8 --modes
split``, H200): 0.71 / 0.86 / 1.22 / 1.95 ms at B8 T4096 H32 D64 for 1 / 2 / 4 / 8 warps (one
warp: 1.8 TB/s), 0.059 / 0.066 / 0.087 / 0.134 ms at B2 T4096 H8.  Not on an op's path yet:
``docs/training_dataflow.md`` has the measurements that keep the one-sweep and staged kernels
there.

Signature (caller-allocated outputs, token tensors flattened to one sequence list)::

    tile_terms(q, k, v, a, b, gk, chunk_start, chunk_len, w, u, A_qk, A_qb, tile_flags, scale)

q, k, a, b, gk [1, T, H, K]; v [1, T, H, V]; w [1, T, H, K]; u [1, T, H, V]; A_qk, A_qb
[1, T, H, 16] (data dtype; row ``r`` of a tile holds its entries against the tile's 16 rows);
chunk_start, chunk_len int32 [slots]; tile_flags int32 [slots · C/16, H].
"""
import triton
import triton.language as tl

from .dplr_tile import (EXACT_ALL, EXACT_FLAGGED, FAST, centred_fits, chunk_tile_rows,
                        load_tile, tile_forward_terms)

BT = 16


def grid(num_slots: int, chunk_size: int, num_heads: int):
    return (num_slots * (chunk_size // BT), num_heads)


@triton.jit
def tile_terms_kernel(q, k, v, a, b, gk, chunk_start, chunk_len, w_out, u_out, A_qk_out,
                      A_qb_out, tile_flags, scale, H, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, TILES_PER_CHUNK: tl.constexpr, MODE: tl.constexpr):
    i_tile = tl.program_id(0)
    i_h = tl.program_id(1)
    flag = tile_flags + i_tile * H + i_h
    slot = i_tile // TILES_PER_CHUNK
    length = tl.load(chunk_len + slot)
    t = i_tile % TILES_PER_CHUNK
    if MODE == EXACT_FLAGGED:
        run = tl.load(flag) != 0
    else:
        run = length > t * BT
    if run:
        dtype: tl.constexpr = w_out.dtype.element_ty
        rows = tl.arange(0, BT)
        tok, valid = chunk_tile_rows(tl.load(chunk_start + slot), length, t, BT)
        q_t, k_t, a_t, b_t, g_t, v_t = load_tile(q, k, v, a, b, gk, tok, valid, i_h, H, K, V,
                                                 0, V)
        (_qg, _kg, _bg, w, u, A_qk, A_qb, Gl, _Ainv, _A_ak, _A_ab, _ag, _G, _Ge,
         centre) = tile_forward_terms(q_t, k_t, a_t, b_t, v_t, g_t, scale, dtype,
                                      MODE != FAST, BT)
        m = valid[:, None]
        row_k = (tok[:, None] * H + i_h) * K + tl.arange(0, K)[None, :]
        row_v = (tok[:, None] * H + i_h) * V + tl.arange(0, V)[None, :]
        row_a = (tok[:, None] * H + i_h) * BT + rows[None, :]
        tl.store(w_out + row_k, w, mask=m)
        tl.store(u_out + row_v, u, mask=m)
        tl.store(A_qk_out + row_a, A_qk, mask=m)
        tl.store(A_qb_out + row_a, A_qb, mask=m)
        if MODE == FAST:
            tl.store(flag, tl.where(centred_fits(Gl, centre), 0, 1))
    elif MODE == FAST:
        tl.store(flag, 0)


def compute(q, k, v, a, b, gk, tables, scale: float, chunk_size: int, bounded: bool,
            num_warps: int = 4):
    """Every tile's terms into buffers allocated here: ``(w, u, A_qk, A_qb, tile_flags)``;
    ``tables``: the call's ``KernelTables`` at ``chunk_size``."""
    T, H, K, V = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    terms = (q.new_empty(1, T, H, K), v.new_empty(1, T, H, V), q.new_empty(1, T, H, BT),
             q.new_empty(1, T, H, BT),
             tables.chunk_start.new_empty(tables.chunk_start.shape[0] * (chunk_size // BT), H))
    launch(q, k, v, a, b, gk, tables.chunk_start, tables.chunk_len, *terms, scale, chunk_size,
           bounded, num_warps=num_warps)
    return terms


def launch(q, k, v, a, b, gk, chunk_start, chunk_len, w, u, A_qk, A_qb, tile_flags,
           scale: float, chunk_size: int, bounded: bool, num_warps: int = 4):
    """Every tile's ``w``, ``u``, ``A_qk``, ``A_qb``: ``FAST`` then ``EXACT_FLAGGED`` for a
    call with a declared gate bound (``bounded``), ``EXACT_ALL`` otherwise."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    modes = (FAST.value, EXACT_FLAGGED.value) if bounded else (EXACT_ALL.value,)
    for mode in modes:
        tile_terms_kernel[grid(chunk_start.shape[0], chunk_size, H)](
            q, k, v, a, b, gk, chunk_start, chunk_len, w, u, A_qk, A_qb, tile_flags, scale,
            H=H, K=K, V=V, BT=BT, TILES_PER_CHUNK=chunk_size // BT, MODE=mode,
            num_warps=num_warps)
