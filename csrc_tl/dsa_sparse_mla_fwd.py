"""Sparse MLA forward (``dsa::sparse_mla_fwd``): attention of every query token over its own
``k`` selected rows of one shared latent kv, in one kernel.

Contract (``torch_dplr.dsa.reference.sparse_mla``, see :func:`ref_program`)::

    logits[t, h, j] = scale · q[t, h] · kv[indices[t, j]]        (valid slots only)
    lse[t, h]       = ln Σ_j exp(logits[t, h, j])                 (-inf: no valid slot)
    o[t, h]         = Σ_j exp(logits[t, h, j] - lse[t, h]) · kv[indices[t, j], :d_v]

A slot is valid when its index lies in ``[0, T_kv)``: ``-1`` (the top-k op's empty slot) is
skipped, and so is any other out-of-range value, so the kernel never reads outside kv (the
PyTorch kernel rejects such indices with a host read; the CUDA op reads none and relies on
this).  A row with no valid slot
gets ``o = 0`` and ``lse = -inf``, as the reference.  Every slot costs the same: a block of only
invalid slots is computed (and contributes nothing).

Grid and tiles
--------------
One CTA per (token, block of ``block_H`` heads), head blocks fastest on a 1-D grid (x has no
65535 limit; the CTAs of one token, which gather the same kv rows, run side by side and meet
in L2).  ``H`` need not be a multiple of ``block_H``: the last block's rows past ``H`` load as
zeros (cp.async zero-fill), compute harmless finite values and are never stored.  The
CTA keeps its ``[block_H, D_qk]`` slice of q in shared memory (value part and rope tail as two
tiles) and walks the row's slots in blocks of ``block_I``:

    gather   the block's kv rows into shared memory by cp.async, 16 bytes per thread and
             instruction, predicated on the slot's validity (an invalid slot's row is
             zero-filled, so its P · V term is an exact 0); the slot mask as a 0 / -inf bias
    S        q · kvᵀ over the value columns plus q_tail · kv_tailᵀ (fp32 accumulator)
    softmax  online, in log2 units: s = S · scale · log2(e) + bias; running max m (starts at
             the lowest finite fp32, so a block of only invalid slots leaves it and gives
             alpha = 1, never inf - inf), l = l · 2^(m_old - m) + Σ 2^(s - m)
    O        O · 2^(m_old - m) + P · kv[:, :d_v], P rounded to the data dtype (the
             tensor-core operand; l sums the fp32 P)

and at the end writes ``o = O / l`` (0 where ``l = 0``) and ``lse = (m + log2 l) · ln 2``
(-inf where ``l = 0``).  With at least one valid slot ``l >= 1`` (the running max's own term).

Pipeline
--------
Hand-rolled double buffer (``num_stages=2``): block i + 1 is gathered into the other buffer
while block i computes; one cp.async commit group per block, ``wait_group(1)`` before block
i's compute, a CTA barrier before the gather of block i + 1 (the other buffer's last readers,
block i - 1's GEMMs, are synchronous) and one after the wait.  Not ``T.Pipelined``: the loads
are explicit predicated cp.async (each thread finds its row's index), so their waits are
explicit too, and the trip count ``ceil(k / block_I)`` is symbolic (csrc_tl/state_fwd.py lists
what the pipeliner did with such loops in TileLang 0.1.15).  The slots past ``k`` in the last
block count as invalid, so ``k`` need not be a multiple of ``block_I``.  ``num_stages=1``
gathers each block just before its compute (half the kv tiles).

Shared memory (:func:`smem_bytes`): q, ``num_stages`` kv tiles, P, the slot masks and the
two row reductions' scratch; TileLang's alignment adds up to ~1 KB.  No config may come within
:data:`_SMEM_MARGIN` of the sm_90 per-CTA limit (232,448 B): at D_qk = 576 with 64 heads per
CTA two buffers of 64 slots would need exactly the limit, so the default there is 32 slots per
block (:func:`block_slots`; 154,624 B as TileLang 0.1.15 lays it out), elsewhere 64.  One CTA
per SM either way at D_qk = 576.  Registers: the fp32 O tile is ``block_H · d_v / threads``
per thread (128 at 64 x 512 over 256 threads).  With block_H = 64 the GEMMs are wgmma (one
warpgroup's M = 64, the two warpgroups split N, so the row max / sum meet in shared memory);
block_H = 16 / 32 (H <= 16 / <= 32) run as mma.sync, each warp owning 16 rows and a multiple
of 8 columns of the S tile.

Signature (caller-allocated outputs; T, T_kv, H and k symbolic)::

    dsa_sparse_mla_fwd(q, kv, indices, scale, o, lse)

q [T, H, D_qk] dtype; kv [T_kv, D_qk] dtype; indices [T, k] int32; scale float;
o [T, H, d_v] dtype; lse [T, H] fp32.  q and kv contiguous and 16-byte aligned (cp.async).
The op ``dsa::sparse_mla_fwd`` launches it on CUDA where :func:`config_for` names a variant
(``torch_dplr/dsa/ops/sparse_mla.py``).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals at definition time.
import itertools
import math

import tilelang.language as T

from .compile import canonical_dtype, kernel_options
from .tile_macros import LOG2E

__all__ = ["dsa_sparse_mla_fwd_kernel", "config_for", "block_heads", "block_slots",
           "smem_bytes", "variants", "ref_program", "DIMS", "DTYPES", "HEAD_BLOCKS"]

#: (D_qk, d_v) pairs built: DeepSeek-V3.2's absorbed MLA (512 latent + 64 rope) and two test
#: sizes (one without a rope tail).
DIMS = ((576, 512), (192, 128), (64, 64))
DTYPES = ("bfloat16", "float16")
#: Heads per CTA: 64 fills a wgmma M; 16 / 32 keep small head counts from padding to 64.
HEAD_BLOCKS = (16, 32, 64)

_ACC = "float32"
_LN2 = math.log(2.0)
_VEC = 8  # elements per 16-byte cp.async (2-byte dtypes)
_SMEM_LIMIT = 232_448  # dynamic shared memory per CTA on sm_90 (227 KiB)
# kept free below the limit: TileLang's buffer alignment (512 B more than smem_bytes at
# D_qk 576) and headroom, so no config launches at the edge of what the GPU allows
_SMEM_MARGIN = 4096

# Warp specialization off (the kernel is not a producer / consumer split; the loads are
# explicit cp.async). TMA off: with symbolic shapes its descriptors would be encoded on the
# host at every launch.
_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True}


def block_heads(H: int) -> int:
    """Heads per CTA for ``H`` heads: the smallest of :data:`HEAD_BLOCKS` holding them, else 64
    (H = 128 runs as two blocks of 64)."""
    return next((b for b in HEAD_BLOCKS if H <= b), HEAD_BLOCKS[-1])


def smem_bytes(D_qk: int, block_H: int, block_I: int, num_stages: int, threads: int = 256) -> int:
    """Shared memory of the kernel (2-byte data): q, the staged kv rows, P, the slot masks and
    the scratch of the two row reductions (fp32 per thread); TileLang's alignment adds up to
    ~1 KB (at D_qk 576, 64 heads, 64 slots, two stages: 232,448 B against 231,936 here)."""
    tiles = block_H * D_qk + num_stages * block_I * D_qk + block_H * block_I
    return 2 * tiles + 4 * num_stages * block_I + 2 * 4 * threads


def _fits(D_qk, block_H, block_I, num_stages, threads) -> bool:
    return smem_bytes(D_qk, block_H, block_I, num_stages, threads) + _SMEM_MARGIN <= _SMEM_LIMIT


def block_slots(D_qk: int, block_H: int, num_stages: int = 2, threads: int = 256) -> int:
    """Slots per block by default: 64, or 32 where 64 would not fit shared memory with the
    margin (D_qk = 576 at 64 heads per CTA, two stages)."""
    return 64 if _fits(D_qk, block_H, 64, num_stages, threads) else 32


def _check_config(D_qk, d_v, dtype, block_H, block_I, num_stages, threads):
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if d_v % 64 or not 64 <= d_v <= 512:  # the O tile's columns are split over 8 warps
        raise ValueError(f"d_v={d_v}: need a multiple of 64 in [64, 512]")
    # the rope tail: 16 columns (32-byte rows) fail to lower to cp.async in TileLang 0.1.15
    if D_qk < d_v or (D_qk - d_v) % 32:
        raise ValueError(f"D_qk={D_qk}: need d_v={d_v} plus a multiple of 32 (the rope tail)")
    if block_H not in HEAD_BLOCKS:
        raise ValueError(f"block_H={block_H} not in {HEAD_BLOCKS}")
    if block_I not in (32, 64):
        raise ValueError(f"block_I={block_I}: 32 or 64 slots per block")
    if num_stages not in (1, 2):
        raise ValueError(f"num_stages={num_stages}: 1 (no prefetch) or 2 (double buffer)")
    if threads not in (128, 256):
        raise ValueError(f"threads={threads}: one or two warpgroups (128 or 256)")
    if block_H * block_I < 16 * 8 * (threads // 32):  # mma.sync: 16 x 8 of S per warp at least
        raise ValueError(f"block_H={block_H}, block_I={block_I}: too small an S tile for "
                         f"{threads // 32} warps")
    if block_H * d_v // threads > 128:
        raise ValueError(f"block_H={block_H}, d_v={d_v}, threads={threads}: the fp32 O tile "
                         f"needs {block_H * d_v // threads} registers per thread (> 128)")
    if not _fits(D_qk, block_H, block_I, num_stages, threads):
        raise ValueError(f"D_qk={D_qk}, block_H={block_H}, block_I={block_I}, num_stages="
                         f"{num_stages}: {smem_bytes(D_qk, block_H, block_I, num_stages, threads)}"
                         f" bytes of shared memory, more than {_SMEM_LIMIT} - {_SMEM_MARGIN}")


@kernel_options(pass_configs=_PASS_CONFIGS)
def dsa_sparse_mla_fwd_kernel(
    D_qk: int,
    d_v: int,
    dtype: str,
    block_H: int = 64,
    block_I: int | None = None,
    num_stages: int = 2,
    threads: int = 256,
):
    """prim_func ``dsa_sparse_mla_fwd(q, kv, indices, scale, o, lse)`` for one config
    (signature in the module docstring).

    D_qk: q / kv row width; d_v: its leading value columns (D_qk - d_v: the rope tail, may be
    0); dtype: bf16 / fp16 data; block_H: heads per CTA (:func:`block_heads`). Schedule knobs
    (same results up to summation order): block_I (slots per block, 32 or 64; default
    :func:`block_slots`), num_stages (2: gather the next block during this one's compute; 1: no
    prefetch), threads (128 or 256).
    """
    dtype = canonical_dtype(dtype)
    if block_I is None:
        block_I = block_slots(D_qk, block_H, num_stages, threads)
    _check_config(D_qk, d_v, dtype, block_H, block_I, num_stages, threads)
    HB, BI = block_H, block_I
    D_tail = D_qk - d_v
    nbuf = num_stages
    f32 = _ACC
    wide = T.GemmWarpPolicy.FullRow  # warps split N when M is one warpgroup's 64 rows or less

    Tn, Tkv, H, K = T.dynamic("T, T_kv, H, K")

    @T.macro
    def gather_columns(kv, indices, t, blk, c0, width, dst, buf):
        """dst[buf, r, :] = kv[row of slot blk·BI + r, c0 : c0 + width] by cp.async, 16 bytes
        per thread and step over the flat (row, 16-byte chunk) range; invalid slots
        zero-filled. Nothing waits here."""
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
                    T.access_ptr(dst[buf, r, col], "w", _VEC),
                    T.access_ptr(kv[T.if_then_else(ok, key, 0), c0 + col], "r", _VEC),
                    _VEC,
                    predicate=ok,
                )

    @T.macro
    def gather_block(kv, indices, t, blk, buf, kv_s, tail_s, bias_s):
        """Issue block ``blk``'s kv rows into buffer ``buf`` as one commit group, and write
        its slot mask (0 valid, -inf not) next to them."""
        gather_columns(kv, indices, t, blk, 0, d_v, kv_s, buf)
        if D_tail:
            gather_columns(kv, indices, t, blk, d_v, D_tail, tail_s, buf)
        T.ptx_commit_group()
        for j in T.Parallel(BI):
            slot = blk * BI + j
            key = T.if_then_else(slot < K, indices[t, T.min(slot, K - 1)], -1)
            bias_s[buf, j] = T.if_then_else((key >= 0) and (key < Tkv), T.float32(0),
                                            -T.infinity(f32))

    @T.macro
    def online_softmax(acc_s, bias_s, buf, c, m, m_prev, m_blk, l, l_blk, alpha):
        """acc_s: the block's q · kv products -> P = 2^(s - m) in place; m, l updated; alpha
        the factor that carries the old O and l over to the new max."""
        for h, j in T.Parallel(HB, BI):
            acc_s[h, j] = acc_s[h, j] * c + bias_s[buf, j]
        T.copy(m, m_prev)
        T.reduce_max(acc_s, m_blk, dim=1)
        for h in T.Parallel(HB):
            m[h] = T.max(m_prev[h], m_blk[h])
            alpha[h] = T.exp2(m_prev[h] - m[h])
        for h, j in T.Parallel(HB, BI):
            acc_s[h, j] = T.exp2(acc_s[h, j] - m[h])
        T.reduce_sum(acc_s, l_blk, dim=1)
        for h in T.Parallel(HB):
            l[h] = l[h] * alpha[h] + l_blk[h]

    @T.prim_func
    def dsa_sparse_mla_fwd(
        q: T.Tensor((Tn, H, D_qk), dtype),
        kv: T.Tensor((Tkv, D_qk), dtype),
        indices: T.Tensor((Tn, K), "int32"),
        scale: T.float32,
        o: T.Tensor((Tn, H, d_v), dtype),
        lse: T.Tensor((Tn, H), f32),
    ):
        n_hb = T.ceildiv(H, HB)
        with T.Kernel(Tn * n_hb, threads=threads) as bx:
            # computed once: an expression would be re-derived at every address below
            t = T.alloc_var("int32", init=bx // n_hb)
            h0 = T.alloc_var("int32", init=(bx % n_hb) * HB)

            q_s = T.alloc_shared((HB, d_v), dtype)
            kv_s = T.alloc_shared((nbuf, BI, d_v), dtype)
            q_tail_s = tail_s = None
            if D_tail:
                q_tail_s = T.alloc_shared((HB, D_tail), dtype)
                tail_s = T.alloc_shared((nbuf, BI, D_tail), dtype)
            bias_s = T.alloc_shared((nbuf, BI), f32)
            p_s = T.alloc_shared((HB, BI), dtype)

            acc_s = T.alloc_fragment((HB, BI), f32)
            acc_o = T.alloc_fragment((HB, d_v), f32)
            m = T.alloc_fragment((HB,), f32)
            m_prev = T.alloc_fragment((HB,), f32)
            m_blk = T.alloc_fragment((HB,), f32)
            l = T.alloc_fragment((HB,), f32)
            l_blk = T.alloc_fragment((HB,), f32)
            alpha = T.alloc_fragment((HB,), f32)

            c = scale * LOG2E  # logits in log2 units
            n_blocks = T.ceildiv(K, BI)

            # q's head block (rows past H zero-filled): two commit groups ahead of block 0's
            T.async_copy(q[t, h0 : h0 + HB, 0:d_v], q_s)
            if D_tail:
                T.async_copy(q[t, h0 : h0 + HB, d_v:D_qk], q_tail_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, T.min_value(f32))  # finite: a block of only invalid slots keeps alpha 1
            if nbuf == 2:
                if n_blocks > 0:
                    gather_block(kv, indices, t, 0, 0, kv_s, tail_s, bias_s)

            for i in T.serial(n_blocks):
                cur = i % nbuf
                # every thread is done with block i - 1 (its GEMMs waited): its buffer is free
                T.sync_threads()
                if nbuf == 2:
                    if i + 1 < n_blocks:
                        gather_block(kv, indices, t, i + 1, 1 - cur, kv_s, tail_s, bias_s)
                        T.ptx_wait_group(1)
                    else:
                        T.ptx_wait_group(0)
                else:
                    gather_block(kv, indices, t, i, 0, kv_s, tail_s, bias_s)
                    T.ptx_wait_group(0)
                T.sync_threads()

                T.gemm(q_s, kv_s[cur, :, :], acc_s, transpose_B=True, clear_accum=True,
                       policy=wide)
                if D_tail:
                    T.gemm(q_tail_s, tail_s[cur, :, :], acc_s, transpose_B=True, policy=wide)
                online_softmax(acc_s, bias_s, cur, c, m, m_prev, m_blk, l, l_blk, alpha)
                for h, d in T.Parallel(HB, d_v):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.copy(acc_s, p_s)
                T.gemm(p_s, kv_s[cur, :, :], acc_o, policy=wide)

            T.ptx_wait_group(0)  # k = 0: q's groups were never waited for
            for h, d in T.Parallel(HB, d_v):
                if h0 + h < H:
                    o[t, h0 + h, d] = T.Cast(dtype, T.if_then_else(
                        l[h] > 0, acc_o[h, d] / l[h], T.float32(0)))
            for h in T.Parallel(HB):
                if h0 + h < H:
                    lse[t, h0 + h] = T.if_then_else(
                        l[h] > 0, (m[h] + T.log2(l[h])) * _LN2, -T.infinity(f32))

    return dsa_sparse_mla_fwd


def variants():
    """Every config the op builds (:func:`config_for`): each (D_qk, d_v) of :data:`DIMS` x
    dtype x heads per CTA, default schedule."""
    for (D_qk, d_v), dt, hb in itertools.product(DIMS, DTYPES, HEAD_BLOCKS):
        yield dict(D_qk=D_qk, d_v=d_v, dtype=dt, block_H=hb)


def config_for(D_qk: int, d_v: int, H: int, dtype) -> dict | None:
    """The variant a call runs (a ``variants()`` entry), or None where none is built: its dims
    must be one of :data:`DIMS`, its dtype one of :data:`DTYPES`."""
    name = str(dtype).removeprefix("torch.")
    if (D_qk, d_v) not in DIMS or name not in DTYPES:
        return None
    return dict(D_qk=D_qk, d_v=d_v, dtype=name, block_H=block_heads(H))


def ref_program(q, kv, indices, scale: float, d_v: int):
    """The contract: the op's PyTorch kernel (fp32 math), ``(o, lse)``."""
    from torch_dplr.dsa.ops.sparse_mla import sparse_mla_fwd_reference

    return sparse_mla_fwd_reference(q, kv, indices, scale, d_v)
