"""The state-free terms of every 64-row chunk at once: the parallel half of the 64-row walk.

One program per (chunk, head) computes the chunk's ``w``, ``u``, ``A_qk`` and ``A_qb`` over
all 64 rows (the staged pipeline's chunk-64 terms, ``torch_dplr.reference``), so that the state
walk (:mod:`csrc_triton.state_sweep` with 64-row tiles) takes one step per chunk: a quarter of
the 16-row walk's serial steps, each a product the tensor cores fill (M = 64).

The chunk is held as four 16-row blocks and everything is formed block by block, in row order,
so that only the blocks a later row needs stay live (the keys' decayed rows, the gated ``a``
rows, ``v`` and the inverse's earlier blocks)::

    diagonal blocks (I, I)   csrc_triton.dplr_tile.intra: centred products, or exact
                             pairwise exponents where the block's gates do not allow them
    blocks below (I > J)     q_I 2^(G_I - E_J) times k_J 2^(E_J - G_J), E_J the gate sum at
                             the end of block J: both factors at most 1 for any gates, so these
                             blocks are exact in every regime and need no check
    (I - A_ab)^-1            diagonal blocks D_I by csrc_triton.dplr_tile.unit_lower_inverse,
                             then X_IJ = D_I Σ_{J<=M<I} N_IM X_MJ (fp32 products)
    w_I = Σ_J X_IJ ag_J      u_I = Σ_J X_IJ Y_J,  Y_J = Σ_M A_ak[J, M] v_M

Rounding points are the staged pipeline's: ``A_qk``, ``A_qb``, ``ag``, ``w``, ``u`` in the
data dtype, ``A_ak``, ``A_ab`` and the inverse in fp32.

HBM traffic (bytes per token and head, bf16 data, fp32 gates, D = K = V)::

    read   q k a b v: 5 · 2D     gk: 4D
    write  w u: 2 · 2D           A_qk A_qb: 2 · 2 · 64

At B8 T4096 H32 D64: 939 MB read, 537 MB written (w, u 268 MB; A_qk, A_qb 268 MB).

Schemes (:mod:`csrc_triton.dplr_tile`): only the diagonal blocks have one.  With a declared
bound ``FAST`` takes centred products there and sets ``block_flags`` for each block whose gates
do not allow them; ``EXACT_FLAGGED`` then redoes the chunks with a flag (the others return at
once); ``EXACT_ALL`` picks the scheme per block (and sets the same flags: they count the blocks
that needed the exact scheme).  ``block_flags`` has the layout of
:mod:`csrc_triton.tile_terms`' tile flags (``[slots · 4, H]``), which
:mod:`csrc_triton.chunk_grads` reads to pick its scheme per chunk.  No host sync either way.

Signature (caller-allocated outputs, token tensors flattened to one sequence list)::

    chunk_terms(q, k, v, a, b, gk, chunk_start, chunk_len, w, u, A_qk, A_qb, block_flags, scale)

q, k, a, b, gk [1, T, H, K]; v [1, T, H, V]; w [1, T, H, K]; u [1, T, H, V]; A_qk, A_qb
[1, T, H, 64] (data dtype; row ``r`` of a chunk holds its entries against the chunk's 64 rows,
zero above the diagonal); chunk_start, chunk_len int32 [slots]; block_flags int32
[slots · 4, H].
"""
import triton
import triton.language as tl

from . import tile_terms
from ._common import dot, dot_fp32, round_to
from .dplr_tile import (EXACT_ALL, EXACT_FLAGGED, FAST, centred_fits, chunk_tile_rows,
                        gate_sums, intra, load_tile, unit_lower_inverse)

CHUNK = 64
BT = 16
BLOCKS = CHUNK // BT


@triton.jit
def below_diagonal(q, a, G, Ge, k_end, b_end, to_block_end, scale, BT: tl.constexpr):
    """Block (I, J > I's rows) of A_qk, A_qb, A_ak, A_ab from row block I (``q``, ``a``, its
    local gate sums ``G``, ``Ge``), key block J's rows decayed to its end (``k_end``,
    ``b_end``) and ``to_block_end = 2^(start of I - end of J)``: three factors of at most 1."""
    qd = q * tl.exp2(G) * to_block_end[None, :]
    ad = a * tl.exp2(Ge) * to_block_end[None, :]
    zero = tl.zeros([BT, BT], dtype=tl.float32)
    return (dot(qd, tl.trans(k_end), zero) * scale, dot(qd, tl.trans(b_end), zero) * scale,
            dot(ad, tl.trans(k_end), zero), dot(ad, tl.trans(b_end), zero))


@triton.jit
def store_block(x, ptr, tok, valid, i_h, H, j, BT: tl.constexpr, WIDTH: tl.constexpr):
    """Columns ``[BT j, BT j + BT)`` of a ``[1, T, H, WIDTH]`` tensor at a block's rows."""
    offsets = (tok[:, None] * H + i_h) * WIDTH + j * BT + tl.arange(0, BT)[None, :]
    tl.store(ptr + offsets, x, mask=valid[:, None])


@triton.jit
def chunk_terms_kernel(q, k, v, a, b, gk, chunk_start, chunk_len, w_out, u_out, A_qk_out,
                       A_qb_out, block_flags, scale, H, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BLOCKS: tl.constexpr, MODE: tl.constexpr):
    slot = tl.program_id(0)
    i_h = tl.program_id(1)
    flags = block_flags + (slot * BLOCKS + tl.arange(0, BLOCKS)) * H + i_h
    length = tl.load(chunk_len + slot)
    if MODE == EXACT_FLAGGED:
        run = tl.sum(tl.load(flags), axis=0) != 0
    else:
        run = length > 0
    if run:
        dtype: tl.constexpr = w_out.dtype.element_ty
        EXACT: tl.constexpr = MODE != FAST
        start = tl.load(chunk_start + slot)
        zero_c = tl.zeros([BT, BT], dtype=tl.float32)
        misfit = tl.zeros([BLOCKS], dtype=tl.int32)
        block_start = tl.zeros([K], dtype=tl.float32)  # gate sum before the block (log2)
        ends = ()     # per earlier block: gate sum at its end
        keys = ()     # per earlier block: (k, b) decayed to its end
        gated_a = ()  # per earlier block: ag (data dtype, as fp32)
        values = ()   # per earlier block: v
        Y = ()        # per earlier block: A_ak v over its row block
        X = ()        # the inverse's blocks, row by row: X[I (I + 1) / 2 + J]
        for I in tl.static_range(BLOCKS):
            tok, valid = chunk_tile_rows(start, length, I, BT)
            q_t, k_t, a_t, b_t, g_t, v_t = load_tile(q, k, v, a, b, gk, tok, valid, i_h, H, K,
                                                     V, 0, V)
            G, Ge, Gl, centre = gate_sums(g_t, BT)
            misfit = tl.where(tl.arange(0, BLOCKS) == I,
                              tl.where(centred_fits(Gl, centre), 0, 1), misfit)
            A_qk, A_qb, A_ak, A_ab = intra(q_t, k_t, a_t, b_t, G, Ge, Gl, centre, scale, EXACT,
                                           BT)
            # row block I of the A matrices, from key block 0 on; the diagonal block last
            A_qk_row = ()
            A_qb_row = ()
            A_ak_row = ()
            A_ab_row = ()
            for J in tl.static_range(I):
                k_end, b_end = keys[J]
                bqk, bqb, bak, bab = below_diagonal(q_t, a_t, G, Ge, k_end, b_end,
                                                    tl.exp2(block_start - ends[J]), scale, BT)
                A_qk_row = A_qk_row + (bqk,)
                A_qb_row = A_qb_row + (bqb,)
                A_ak_row = A_ak_row + (bak,)
                A_ab_row = A_ab_row + (bab,)
            A_qk_row = A_qk_row + (A_qk,)
            A_qb_row = A_qb_row + (A_qb,)
            A_ak_row = A_ak_row + (A_ak,)
            A_ab_row = A_ab_row + (A_ab,)
            # row block I of (I - A_ab)^-1: D_I on the diagonal, D_I Σ_M N_IM X_MJ below
            D = unit_lower_inverse(A_ab, BT)
            X_row = ()
            for J in tl.static_range(I):
                acc = zero_c
                for M in tl.static_range(J, I):
                    acc = dot_fp32(A_ab_row[M], X[M * (M + 1) // 2 + J], acc)
                X_row = X_row + (dot_fp32(D, acc, zero_c),)
            X_row = X_row + (D,)
            # this block's own contributions to w and u, then its terms for later blocks
            ag = round_to(a_t * tl.exp2(block_start[None, :] + Ge), dtype).to(tl.float32)
            y = tl.zeros_like(v_t)
            for J in tl.static_range(I):
                y = dot(A_ak_row[J], values[J], y)
            y = dot(A_ak, v_t, y)
            w_t = tl.zeros_like(q_t)
            u_t = tl.zeros_like(v_t)
            for J in tl.static_range(I):
                w_t = dot(X_row[J], gated_a[J], w_t)
                u_t = dot(X_row[J], Y[J], u_t)
            w_t = dot(D, ag, w_t)
            u_t = dot(D, y, u_t)
            row_k = (tok[:, None] * H + i_h) * K + tl.arange(0, K)[None, :]
            row_v = (tok[:, None] * H + i_h) * V + tl.arange(0, V)[None, :]
            m = valid[:, None]
            tl.store(w_out + row_k, round_to(w_t, dtype), mask=m)
            tl.store(u_out + row_v, round_to(u_t, dtype), mask=m)
            for J in tl.static_range(BLOCKS):
                if J <= I:
                    store_block(round_to(A_qk_row[J], dtype), A_qk_out, tok, valid, i_h, H, J,
                                BT, BT * BLOCKS)
                    store_block(round_to(A_qb_row[J], dtype), A_qb_out, tok, valid, i_h, H, J,
                                BT, BT * BLOCKS)
                else:  # the walk multiplies whole rows: zeros, never stale memory
                    store_block(zero_c.to(dtype), A_qk_out, tok, valid, i_h, H, J, BT,
                                BT * BLOCKS)
                    store_block(zero_c.to(dtype), A_qb_out, tok, valid, i_h, H, J, BT,
                                BT * BLOCKS)
            block_end = block_start + Gl
            to_end = tl.exp2(Gl[None, :] - G)
            ends = ends + (block_end,)
            keys = keys + ((k_t * to_end, b_t * to_end),)
            gated_a = gated_a + (ag,)
            values = values + (v_t,)
            Y = Y + (y,)
            X = X + X_row
            block_start = block_end
        if MODE != EXACT_FLAGGED:
            tl.store(flags, misfit)
    elif MODE != EXACT_FLAGGED:
        tl.store(flags, tl.zeros([BLOCKS], dtype=tl.int32))


def compute(q, k, v, a, b, gk, tables, scale: float, bounded: bool, num_warps: int = 4):
    """Every chunk's terms into buffers allocated here: ``(w, u, A_qk, A_qb, block_flags)``;
    ``tables``: the call's ``KernelTables`` at chunk 64."""
    T, H, K, V = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    slots = tables.chunk_start.shape[0]
    terms = (q.new_empty(1, T, H, K), v.new_empty(1, T, H, V), q.new_empty(1, T, H, CHUNK),
             q.new_empty(1, T, H, CHUNK), tables.chunk_start.new_empty(slots * BLOCKS, H))
    launch(q, k, v, a, b, gk, tables.chunk_start, tables.chunk_len, *terms, scale, bounded,
           num_warps=num_warps)
    return terms


def compute_for_walk(q, k, v, a, b, gk, tables, scale: float, chunk_size: int, bounded: bool,
                     walk_rows: int, num_warps: int = 4):
    """The terms a walk of ``walk_rows``-row steps reads, into buffers allocated here:
    ``(w, u, A_qk, A_qb, flags)``, every 16-row tile's (:mod:`csrc_triton.tile_terms`, 16) or
    every chunk's (this module, 64 at chunk 64); ``flags`` per 16 rows either way."""
    if walk_rows == CHUNK and chunk_size == CHUNK:
        return compute(q, k, v, a, b, gk, tables, scale, bounded, num_warps=num_warps)
    if walk_rows == BT:
        return tile_terms.compute(q, k, v, a, b, gk, tables, scale, chunk_size, bounded,
                                  num_warps=num_warps)
    raise ValueError(f"walk_rows={walk_rows} must be {BT}, or {CHUNK} at chunk {CHUNK} "
                     f"(chunk_size={chunk_size})")


def launch(q, k, v, a, b, gk, chunk_start, chunk_len, w, u, A_qk, A_qb, block_flags,
           scale: float, bounded: bool, num_warps: int = 4):
    """Every chunk's ``w``, ``u``, ``A_qk``, ``A_qb``: ``FAST`` then ``EXACT_FLAGGED`` for a
    call with a declared gate bound (``bounded``), ``EXACT_ALL`` otherwise."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    modes = (FAST.value, EXACT_FLAGGED.value) if bounded else (EXACT_ALL.value,)
    for mode in modes:
        chunk_terms_kernel[(chunk_start.shape[0], H)](
            q, k, v, a, b, gk, chunk_start, chunk_len, w, u, A_qk, A_qb, block_flags, scale,
            H=H, K=K, V=V, BT=BT, BLOCKS=BLOCKS, MODE=mode, num_warps=num_warps)
