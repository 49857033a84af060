"""Sparse MLA backward (``dsa::sparse_mla_bwd``): dq and dkv of the forward
(``csrc_tl/dsa_sparse_mla_fwd.py``) in one kernel.

Contract (``torch_dplr.dsa.reference.sparse_mla``, see :func:`ref_program`)::

    P[t, h, j]  = exp(scale · q[t, h] · kv[indices[t, j]] - lse[t, h])    (valid slots, else 0)
    delta[t, h] = Σ_d do[t, h, d] · o[t, h, d] - dlse[t, h]
    dS[t, h, j] = P · (do[t, h] · kv[indices[t, j], :d_v] - delta[t, h])
    dq[t, h]    = scale · Σ_j dS · kv[indices[t, j]]
    dkv[key]        += scale · Σ_h dS[t, h, j] · q[t, h]
    dkv[key, :d_v]  += Σ_h P[t, h, j] · do[t, h]

over every (t, j) whose index is ``key``.  Slots are valid as in the forward (index in
``[0, T_kv)``); the others, and rows without a valid slot, contribute nothing.

Grid and tiles
--------------
As the forward: one CTA per (token, block of ``block_H`` heads), head blocks fastest; heads
past ``H`` load q, do, o, lse and dlse as zeros, so their P · do and dS are exact zeros and
their dq rows are never stored.  The CTA keeps q (value part and rope tail) and do of its
heads in shared memory, first forms ``delta`` from do and o, then walks the slots in blocks of
``block_I``:

    gather   the block's kv rows by predicated cp.async (invalid slots zero-filled, their
             keys kept as -1 for the scatter)
    S, dP    q · kvᵀ (plus the tails) and do · kv[:, :d_v]ᵀ, fp32
    P, dS    P = 2^(S · scale · log2 e - lse · log2 e) on valid slots (a select, so no
             inf - inf), dS = scale · P · (dP - delta); both rounded to the data dtype (the
             tensor-core operands)
    dq       += dS · kv (fp32, in registers for the whole walk)
    dkv      per 64 value columns: dSᵀ · q + Pᵀ · do, then the tail's dSᵀ · q_tail, each
             staged in shared memory and added to the fp32 ``dkv`` with 16-byte atomics

One kv buffer: the next block's gather is issued right after the dq product (the buffer's
last reader) and lands while the dkv products and atomics, which read only q, do, P and dS,
run.  ``k`` need not be a multiple of ``block_I`` (the slots past it are invalid).

The scatter into dkv: atomics, not a deterministic scheme
---------------------------------------------------------
A deterministic dkv needs every key's list of (token, slot) pairs (a sort of the indices per
step) and a second pass that recomputes P and dS per key; the atomics instead add each CTA's
fp32 block into an fp32 ``dkv`` that the caller zeroes and casts to the data dtype.  Each add
rounds in fp32, in an order the scheduler picks: two runs differ by fp32 reordering error, at
most ``(n - 1) · 2⁻²⁴ · Σ|terms|`` for a row selected by ``n`` (token, head block) pairs
(first order), and after the cast by that plus one unit in the last place of the data dtype.
dq is deterministic (each CTA owns its rows).

Shared memory (:func:`smem_bytes`): q, do, one kv block, P, dS, the two fp32 staging tiles and
the keys; at D_qk = 576 with 64 heads per CTA 32 slots per block (201,728 B as TileLang
0.1.15 lays it out), elsewhere 64 (:func:`block_slots`), each at least :data:`_SMEM_MARGIN`
under the sm_90 limit.  Registers: the fp32 dq tile, ``block_H · D_qk / threads`` per thread
(144 at 64 x 576 over 256 threads, where ptxas of CUDA 13 uses all 255 and spills 12 bytes;
no other variant spills).

Self-contained on purpose: the disk cache keys a kernel on its own module's source (and
csrc_tl's shared files), so no code that emits TIR comes from the forward's module.

Signature (caller-allocated outputs; T, T_kv, H and k symbolic)::

    dsa_sparse_mla_bwd(q, kv, indices, o, lse, do, dlse, scale, dq, dkv)

q [T, H, D_qk], kv [T_kv, D_qk], o and do [T, H, d_v] dtype; indices [T, k] int32; lse and
dlse [T, H] fp32; scale float; dq [T, H, D_qk] dtype; dkv [T_kv, D_qk] fp32, zeroed by the
caller (accumulated into).  q, kv, o and do contiguous and 16-byte aligned (cp.async and
16-byte loads).  The op
``dsa::sparse_mla_bwd`` launches it on CUDA where :func:`config_for` names a variant (the
forward's rule; ``torch_dplr/dsa/ops/sparse_mla.py``).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals at definition time.
import itertools

import tilelang.language as T

from .compile import canonical_dtype, kernel_options
# which configs exist (not what a config emits): the backward runs wherever the forward does
from .dsa_sparse_mla_fwd import DIMS, DTYPES, HEAD_BLOCKS, block_heads, config_for
from .tile_macros import LOG2E

__all__ = ["dsa_sparse_mla_bwd_kernel", "config_for", "block_heads", "block_slots",
           "smem_bytes", "variants", "ref_program", "DIMS", "DTYPES", "HEAD_BLOCKS"]

_ACC = "float32"
_VEC = 8  # elements per 16-byte cp.async (2-byte dtypes)
_COLS = 64  # dkv columns per product and staging tile: 8 fp32 registers a thread at 32 slots
_SMEM_LIMIT = 232_448  # dynamic shared memory per CTA on sm_90 (227 KiB)
_SMEM_MARGIN = 4096  # TileLang's buffer alignment and headroom, as in the forward

# as the forward: no producer / consumer split (the loads are explicit cp.async), no TMA
# (symbolic shapes would re-encode its descriptors on the host every launch)
_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True}


def smem_bytes(D_qk: int, d_v: int, block_H: int, block_I: int, threads: int = 256) -> int:
    """Shared memory of the kernel (2-byte data): q, do, one kv block, P and dS; the fp32
    staging of a 64-column dkv tile and of the tail's; the keys of two blocks; the scratch of
    the delta reduction.  TileLang's alignment adds up to ~1 KB."""
    tiles = block_H * D_qk + block_H * d_v + block_I * D_qk + 2 * block_H * block_I
    staging = block_I * (_COLS + D_qk - d_v)
    return 2 * tiles + 4 * staging + 4 * 2 * block_I + 4 * threads


def _fits(D_qk, d_v, block_H, block_I, threads) -> bool:
    return smem_bytes(D_qk, d_v, block_H, block_I, threads) + _SMEM_MARGIN <= _SMEM_LIMIT


def block_slots(D_qk: int, d_v: int, block_H: int, threads: int = 256) -> int:
    """Slots per block by default: 64, or 32 where 64 would not fit shared memory with the
    margin (D_qk = 576 at 64 heads per CTA)."""
    return 64 if _fits(D_qk, d_v, block_H, 64, threads) else 32


def _check_config(D_qk, d_v, dtype, block_H, block_I, threads):
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if d_v % _COLS or not _COLS <= d_v <= 512:  # dkv's value columns go in 64-column tiles
        raise ValueError(f"d_v={d_v}: need a multiple of {_COLS} in [{_COLS}, 512]")
    D_tail = D_qk - d_v
    # a tail of 16 columns fails to lower to cp.async (as in the forward); more than 64 would
    # need a second staging tile
    if D_tail < 0 or D_tail % 32 or D_tail > _COLS:
        raise ValueError(f"D_qk={D_qk}: need d_v={d_v} plus 0, 32 or 64 (the rope tail)")
    if block_H not in HEAD_BLOCKS:
        raise ValueError(f"block_H={block_H} not in {HEAD_BLOCKS}")
    if block_I not in (32, 64):
        raise ValueError(f"block_I={block_I}: 32 or 64 slots per block")
    if threads not in (128, 256):
        raise ValueError(f"threads={threads}: one or two warpgroups (128 or 256)")
    warps = threads // 32
    if min(block_H * block_I, block_I * min(_COLS, D_tail or _COLS)) < 16 * 8 * warps:
        raise ValueError(f"block_H={block_H}, block_I={block_I}: too small a tile for "
                         f"{warps} warps (mma.sync: 16 x 8 per warp)")
    if block_H * D_qk // threads > 144:  # more leaves too few of the 255 for the rest
        raise ValueError(f"block_H={block_H}, D_qk={D_qk}, threads={threads}: the fp32 dq tile "
                         f"needs {block_H * D_qk // threads} registers per thread (> 144)")
    if not _fits(D_qk, d_v, block_H, block_I, threads):
        raise ValueError(f"D_qk={D_qk}, block_H={block_H}, block_I={block_I}: "
                         f"{smem_bytes(D_qk, d_v, block_H, block_I, threads)} bytes of shared "
                         f"memory, more than {_SMEM_LIMIT} - {_SMEM_MARGIN}")


@kernel_options(pass_configs=_PASS_CONFIGS)
def dsa_sparse_mla_bwd_kernel(
    D_qk: int,
    d_v: int,
    dtype: str,
    block_H: int = 64,
    block_I: int | None = None,
    threads: int = 256,
):
    """prim_func ``dsa_sparse_mla_bwd(q, kv, indices, o, lse, do, dlse, scale, dq, dkv)`` for
    one config (signature in the module docstring).

    D_qk, d_v, dtype, block_H: as the forward's factory (the same configs, :func:`config_for`).
    Schedule knobs (same results up to summation order): block_I (slots per block, 32 or 64;
    default :func:`block_slots`), threads (128 or 256).
    """
    dtype = canonical_dtype(dtype)
    if block_I is None:
        block_I = block_slots(D_qk, d_v, block_H, threads)
    _check_config(D_qk, d_v, dtype, block_H, block_I, threads)
    HB, BI, CW = block_H, block_I, _COLS
    D_tail = D_qk - d_v
    f32 = _ACC
    wide = T.GemmWarpPolicy.FullRow  # as the forward: warps split N when M is 64 rows or less

    Tn, Tkv, H, K = T.dynamic("T, T_kv, H, K")

    @T.macro
    def gather_columns(kv, t, blk, c0, width, dst, indices):
        """dst[r, :] = kv[row of slot blk·BI + r, c0 : c0 + width] by cp.async, 16 bytes per
        thread and step; invalid slots zero-filled (their S and dP are exact zeros)."""
        per_row = width // _VEC
        tx = T.get_thread_binding()
        for step in T.unroll(T.ceildiv(BI * per_row, threads)):
            flat = step * threads + tx
            r = flat // per_row
            col = (flat % per_row) * _VEC
            if flat < BI * per_row:
                slot = blk * BI + r
                key = T.if_then_else(slot < K, indices[t, T.min(slot, K - 1)], -1)
                ok = (key >= 0) and (key < Tkv)
                T.ptx_cp_async(
                    T.access_ptr(dst[r, col], "w", _VEC),
                    T.access_ptr(kv[T.if_then_else(ok, key, 0), c0 + col], "r", _VEC),
                    _VEC,
                    predicate=ok,
                )

    @T.macro
    def gather_block(kv, indices, t, blk, kv_s, tail_s, keys_s, buf):
        """Issue block ``blk``'s kv rows as one commit group; its keys (-1: invalid) into
        ``keys_s[buf]``, for P's mask and the scatter."""
        gather_columns(kv, t, blk, 0, d_v, kv_s, indices)
        if D_tail:
            gather_columns(kv, t, blk, d_v, D_tail, tail_s, indices)
        T.ptx_commit_group()
        for j in T.Parallel(BI):
            slot = blk * BI + j
            key = T.if_then_else(slot < K, indices[t, T.min(slot, K - 1)], -1)
            keys_s[buf, j] = T.if_then_else((key >= 0) and (key < Tkv), key, -1)

    @T.macro
    def scatter(acc, stage_s, keys_s, buf, dkv, c0, width):
        """dkv[key of row r, c0 : c0 + width] += acc[r, :] for the block's valid slots: staged
        in shared memory so each thread adds 4 consecutive floats of one row."""
        T.copy(acc, stage_s)
        for r, c in T.Parallel(BI, width // 4):
            if keys_s[buf, r] >= 0:
                T.atomic_addx4(dkv[keys_s[buf, r], c0 + c * 4], stage_s[r, c * 4])

    @T.prim_func
    def dsa_sparse_mla_bwd(
        q: T.Tensor((Tn, H, D_qk), dtype),
        kv: T.Tensor((Tkv, D_qk), dtype),
        indices: T.Tensor((Tn, K), "int32"),
        o: T.Tensor((Tn, H, d_v), dtype),
        lse: T.Tensor((Tn, H), f32),
        do: T.Tensor((Tn, H, d_v), dtype),
        dlse: T.Tensor((Tn, H), f32),
        scale: T.float32,
        dq: T.Tensor((Tn, H, D_qk), dtype),
        dkv: T.Tensor((Tkv, D_qk), f32),
    ):
        n_hb = T.ceildiv(H, HB)
        with T.Kernel(Tn * n_hb, threads=threads) as bx:
            t = T.alloc_var("int32", init=bx // n_hb)
            h0 = T.alloc_var("int32", init=(bx % n_hb) * HB)

            q_s = T.alloc_shared((HB, d_v), dtype)
            do_s = T.alloc_shared((HB, d_v), dtype)
            kv_s = T.alloc_shared((BI, d_v), dtype)
            q_tail_s = tail_s = tail_stage_s = None
            if D_tail:
                q_tail_s = T.alloc_shared((HB, D_tail), dtype)
                tail_s = T.alloc_shared((BI, D_tail), dtype)
                tail_stage_s = T.alloc_shared((BI, D_tail), f32)
            p_s = T.alloc_shared((HB, BI), dtype)
            ds_s = T.alloc_shared((HB, BI), dtype)
            stage_s = T.alloc_shared((BI, CW), f32)
            keys_s = T.alloc_shared((2, BI), "int32")

            acc_s = T.alloc_fragment((HB, BI), f32)
            acc_dp = T.alloc_fragment((HB, BI), f32)
            acc_dq = T.alloc_fragment((HB, d_v), f32)
            acc_dq_tail = T.alloc_fragment((HB, D_tail), f32) if D_tail else None
            acc_kv = T.alloc_fragment((BI, CW), f32)
            acc_kv_tail = T.alloc_fragment((BI, D_tail), f32) if D_tail else None
            prod = T.alloc_fragment((HB, CW), f32)
            delta = T.alloc_fragment((HB,), f32)
            # per-row values read by the P / dS loop (in the S tile's layout) live in shared
            # memory: a fragment would need that layout and delta's reduction another
            delta_s = T.alloc_shared((HB,), f32)
            lse2_s = T.alloc_shared((HB,), f32)

            c = scale * LOG2E
            n_blocks = T.ceildiv(K, BI)

            # q and do of the head block (rows past H zero-filled), then block 0's rows
            T.async_copy(q[t, h0 : h0 + HB, 0:d_v], q_s)
            if D_tail:
                T.async_copy(q[t, h0 : h0 + HB, d_v:D_qk], q_tail_s)
            T.async_copy(do[t, h0 : h0 + HB, :], do_s)
            if n_blocks > 0:
                gather_block(kv, indices, t, 0, kv_s, tail_s, keys_s, 0)
                T.ptx_wait_group(1)  # all but block 0's group: q and do are in
            else:
                T.ptx_wait_group(0)
            T.sync_threads()

            # delta = rowsum(do · o) - dlse while block 0's rows land; lse in log2 units
            T.fill(prod, 0)
            for cc in T.serial(d_v // CW):
                for h, d in T.Parallel(HB, CW):
                    prod[h, d] += T.Cast(f32, do_s[h, cc * CW + d]) * T.if_then_else(
                        h0 + h < H, T.Cast(f32, o[t, h0 + h, cc * CW + d]), T.float32(0))
            T.reduce_sum(prod, delta, dim=1)
            for h in T.Parallel(HB):
                delta_s[h] = delta[h] - T.if_then_else(h0 + h < H, dlse[t, h0 + h], T.float32(0))
                lse2_s[h] = T.if_then_else(h0 + h < H, lse[t, h0 + h] * LOG2E, T.float32(0))
            T.fill(acc_dq, 0)
            if D_tail:
                T.fill(acc_dq_tail, 0)

            for i in T.serial(n_blocks):
                cur = i % 2
                T.ptx_wait_group(0)
                T.sync_threads()  # block i's rows and keys visible to every thread

                T.gemm(q_s, kv_s, acc_s, transpose_B=True, clear_accum=True, policy=wide)
                if D_tail:
                    T.gemm(q_tail_s, tail_s, acc_s, transpose_B=True, policy=wide)
                T.gemm(do_s, kv_s, acc_dp, transpose_B=True, clear_accum=True, policy=wide)
                for h, j in T.Parallel(HB, BI):
                    # a select: an invalid slot gives 0 whatever S - lse is (a row without
                    # a valid slot has lse = -inf)
                    acc_s[h, j] = T.if_then_else(keys_s[cur, j] >= 0,
                                                 T.exp2(acc_s[h, j] * c - lse2_s[h]), T.float32(0))
                    acc_dp[h, j] = acc_s[h, j] * (acc_dp[h, j] - delta_s[h]) * scale
                T.copy(acc_s, p_s)
                T.copy(acc_dp, ds_s)
                T.gemm(ds_s, kv_s, acc_dq, policy=wide)
                if D_tail:
                    T.gemm(ds_s, tail_s, acc_dq_tail, policy=wide)

                T.sync_threads()  # kv_s read for the last time in this block: refill it
                if i + 1 < n_blocks:
                    gather_block(kv, indices, t, i + 1, kv_s, tail_s, keys_s, 1 - cur)

                for cc in T.serial(d_v // CW):
                    T.gemm(ds_s, q_s[:, cc * CW : (cc + 1) * CW], acc_kv, transpose_A=True,
                           clear_accum=True)
                    T.gemm(p_s, do_s[:, cc * CW : (cc + 1) * CW], acc_kv, transpose_A=True)
                    scatter(acc_kv, stage_s, keys_s, cur, dkv, cc * CW, CW)
                if D_tail:
                    T.gemm(ds_s, q_tail_s, acc_kv_tail, transpose_A=True, clear_accum=True)
                    scatter(acc_kv_tail, tail_stage_s, keys_s, cur, dkv, d_v, D_tail)

            for h, d in T.Parallel(HB, d_v):
                if h0 + h < H:
                    dq[t, h0 + h, d] = T.Cast(dtype, acc_dq[h, d])
            if D_tail:
                for h, d in T.Parallel(HB, D_tail):
                    if h0 + h < H:
                        dq[t, h0 + h, d_v + d] = T.Cast(dtype, acc_dq_tail[h, d])

    return dsa_sparse_mla_bwd


def variants():
    """Every config the op builds: the forward's (each (D_qk, d_v) of :data:`DIMS` x dtype x
    heads per CTA), default schedule."""
    for (D_qk, d_v), dt, hb in itertools.product(DIMS, DTYPES, HEAD_BLOCKS):
        yield dict(D_qk=D_qk, d_v=d_v, dtype=dt, block_H=hb)


def ref_program(q, kv, indices, o, lse, do, dlse, scale: float, d_v: int):
    """The contract: the op's PyTorch kernel (fp32 math), ``(dq, dkv)``."""
    from torch_dplr.dsa.ops.sparse_mla import sparse_mla_bwd_reference

    return sparse_mla_bwd_reference(q, kv, indices, o, lse, do, dlse, scale, d_v)
