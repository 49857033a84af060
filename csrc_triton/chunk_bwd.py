"""The chunked backward in one reverse sweep: every input gradient and the initial-state
gradient from q, k, v, a, b, gk, the chunk-start states the forward saved, do and the
final-state gradient.

One program per (head, sequence) walks the chunks from the last, with the state gradient
``dh [K, V]`` (fp32) in registers.  A chunk of ``C = BT · TILES_PER_CHUNK`` rows starts from
its saved state; when it holds several tiles, the states at their starts are recomputed
first (a forward pass over the chunk's tiles, into a per-program fp32 workspace of
``TILES_PER_CHUNK - 1`` states that stays in L2), then the tiles are differentiated from the
last (:func:`csrc_triton.dplr_tile_bwd.tile_backward`).

HBM traffic (bytes per token and head, bf16 data, fp32 gates, D = K = V)::

    read   q k v a b do: 6 · 2D     gk: 4D      states: 4·D·D / C
    write  dq dk dv da db: 5 · 2D   dgk: 4D

At B8 T4096 H32 D64, chunk 64: 1.07 GB read (inputs, do, 268 MB of states), 939 MB written.

Signature::

    chunk_bwd(q, k, v, a, b, gk, h, do, dht, cu_seqlens, chunk_offsets, flags, workspace,
              dq, dk, dv, da, db, dgk, dh0, scale, ...)

``MODE`` as in :mod:`csrc_triton.chunk_fwd`, with the forward's ``flags``: ``FAST`` skips the
flagged (sequence, head) pairs, ``EXACT_FLAGGED`` does only those.

h [1, slots, H, K, V] fp32 (the forward's states); dht [N, H, K, V] fp32 (read when
``USE_DHT``); workspace fp32 [N * H, max(TILES_PER_CHUNK - 1, 1), K, V]; dh0 [N, H, K, V] fp32
(written when ``WRITE_DH0``); gradients in their inputs' shapes and dtypes.
"""
import triton
import triton.language as tl

from .chunk_fwd import BT_DEFAULT
from .dplr_tile import (EXACT_ALL, EXACT_FLAGGED, FAST, sequence_of, tile_forward_step,
                        tile_rows)
from .dplr_tile_bwd import tile_backward_stored


def grid(num_heads: int, num_seqs: int):
    return (num_heads, num_seqs)


def workspace_shape(num_heads: int, num_seqs: int, tiles_per_chunk: int, K: int, V: int):
    return (num_seqs * num_heads, max(tiles_per_chunk - 1, 1), K, V)


@triton.jit
def chunk_bwd_kernel(q, k, v, a, b, gk, h_saved, do, dht, cu_seqlens, chunk_offsets, flags,
                     workspace, dq, dk, dv, da, db, dgk, dh0, scale,
                     H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     TILES_PER_CHUNK: tl.constexpr, USE_DHT: tl.constexpr,
                     WRITE_DH0: tl.constexpr, MODE: tl.constexpr, REVERSE: tl.constexpr,
                     STATE_SPLIT: tl.constexpr):
    i_h = tl.program_id(0)
    i_n = tl.program_id(1)
    # FAST leaves the pairs the forward flagged to EXACT_FLAGGED
    if MODE == FAST:
        run = tl.load(flags + i_n * H + i_h) == 0
    elif MODE == EXACT_FLAGGED:
        run = tl.load(flags + i_n * H + i_h) != 0
    else:
        run = True
    if run:
        _reverse_sweep(q, k, v, a, b, gk, h_saved, do, dht, cu_seqlens, chunk_offsets,
                       workspace, dq, dk, dv, da, db, dgk, dh0, scale, i_h, i_n, H, K, V, BT,
                       TILES_PER_CHUNK, USE_DHT, WRITE_DH0, MODE != FAST, REVERSE, STATE_SPLIT)


@triton.jit
def _reverse_sweep(q, k, v, a, b, gk, h_saved, do, dht, cu_seqlens, chunk_offsets, workspace,
                   dq, dk, dv, da, db, dgk, dh0, scale, i_h, i_n, H,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   TILES_PER_CHUNK: tl.constexpr, USE_DHT: tl.constexpr,
                   WRITE_DH0: tl.constexpr, EXACT: tl.constexpr, REVERSE: tl.constexpr,
                   STATE_SPLIT: tl.constexpr):
    dtype: tl.constexpr = dq.dtype.element_ty
    C: tl.constexpr = BT * TILES_PER_CHUNK
    bos, eos, slot0 = sequence_of(cu_seqlens, chunk_offsets, i_n)
    ck = tl.arange(0, K)
    cv = tl.arange(0, V)
    state_offsets = ck[:, None] * V + cv[None, :]
    seq_state = (i_n * H + i_h) * K * V
    ws = workspace + (i_n * H + i_h).to(tl.int64) * max(TILES_PER_CHUNK - 1, 1) * K * V
    if USE_DHT:
        dh = tl.load(dht + seq_state + state_offsets)
    else:
        dh = tl.zeros([K, V], dtype=tl.float32)
    length = eos - bos
    n_tiles = tl.cdiv(length, BT)
    n_chunks = tl.cdiv(length, C)
    for cr in range(n_chunks):
        c = n_chunks - 1 - cr
        h_chunk = tl.load(h_saved + ((slot0 + c) * H + i_h) * K * V + state_offsets)
        t_first = c * TILES_PER_CHUNK
        t_end = tl.minimum(t_first + TILES_PER_CHUNK, n_tiles)
        if TILES_PER_CHUNK > 1:
            # the states at the starts of the chunk's later tiles, into the workspace
            h = h_chunk
            for t in range(t_first, t_end - 1):
                tok, valid = tile_rows(bos, eos, t, BT, REVERSE)
                h = tile_forward_step(q, k, v, a, b, gk, tok, valid, i_h, H, K, V, h, scale,
                                      dtype, EXACT, BT, STATE_SPLIT)
                tl.store(ws + (t - t_first) * K * V + state_offsets, h)
            tl.debug_barrier()
        for tr in range(t_end - t_first):
            t = t_end - 1 - tr
            if t == t_first:
                h = h_chunk
            else:
                h = tl.load(ws + (t - t_first - 1) * K * V + state_offsets)
            tok, valid = tile_rows(bos, eos, t, BT, REVERSE)
            dh = tile_backward_stored(q, k, v, a, b, gk, do, tok, valid, i_h, H, K, V, h, dh,
                                      dq, dk, dv, da, db, dgk, scale, dtype, EXACT, BT,
                                      STATE_SPLIT)
        if TILES_PER_CHUNK > 1:
            tl.debug_barrier()  # the workspace is rewritten by the next chunk
    if WRITE_DH0:
        tl.store(dh0 + seq_state + state_offsets, dh)


def launch(q, k, v, a, b, gk, h, do, dht, cu_seqlens, chunk_offsets, flags, workspace,
           dq, dk, dv, da, db, dgk, dh0, scale: float, chunk_size: int, use_dht: bool,
           write_dh0: bool, bounded: bool, reverse: bool = False, num_warps: int = 4,
           num_stages: int = 1, state_split: bool = True):
    """Run the backward on flattened tensors, in the forward's schemes (its ``flags``);
    ``state_split`` as in ``chunk_fwd.launch`` (pass the forward's)."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    modes = (FAST.value, EXACT_FLAGGED.value) if bounded else (EXACT_ALL.value,)
    for mode in modes:
        chunk_bwd_kernel[grid(H, N)](q, k, v, a, b, gk, h, do, dht, cu_seqlens, chunk_offsets,
                                     flags, workspace, dq, dk, dv, da, db, dgk, dh0, scale,
                                     H=H, K=K, V=V, BT=BT_DEFAULT,
                                     TILES_PER_CHUNK=chunk_size // BT_DEFAULT,
                                     USE_DHT=use_dht, WRITE_DH0=write_dh0, MODE=mode,
                                     REVERSE=reverse, STATE_SPLIT=state_split,
                                     num_warps=num_warps, num_stages=num_stages)
