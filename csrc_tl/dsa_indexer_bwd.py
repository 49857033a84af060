"""Lightning-indexer backward (``dsa::indexer_bwd``): dq_idx, dk_idx and dw of the selected
scores (``csrc_tl/dsa_indexer_fwd.py``) in one kernel.

Contract (``torch_dplr.dsa.reference.indexer``, see :func:`ref_program`)::

    S[t, h, j]  = q_idx[t, h] · k_idx[indices[t, j]]                       (valid slots)
    G[t, h, j]  = dscores[t, j] · w[t, h] · [S[t, h, j] > 0]              (0 elsewhere)
    dw[t, h]    = Σ_j dscores[t, j] · ReLU(S[t, h, j])
    dq_idx[t, h] = Σ_j G[t, h, j] · k_idx[indices[t, j]]
    dk_idx[key]  += Σ_h G[t, h, j] · q_idx[t, h]        over every (t, j) whose index is key

Slots are valid as in the forward (index in ``[0, T)``); the others contribute nothing, and
their ``dscores`` are never used (a NaN there changes nothing).  ReLU's gradient at 0 is 0,
as ``torch.relu``'s.

Grid and tiles
--------------
As the forward: one CTA per query token, which keeps ``q_idx [H, D]`` and ``w [H]`` in shared
memory and walks its slots in blocks of ``block_I``:

    gather   the block's k_idx rows by predicated cp.async (invalid slots zero-filled), its keys
             (-1: invalid) and its dscores (0 on invalid slots) next to them
    S        K_blk [block_I, D] · Q [H, D]ᵀ, fp32 (wgmma: M = the slots, N = the heads)
    dw       ``dscores · ReLU(S)`` added elementwise into an fp32 tile in S's layout, summed
             over the slots once at the end
    G        two tensor-core operands, each in [-1, 1] (next section): Gq = ŝ · [S > 0] and
             Gk = ŵ · [S > 0], rounded to the data dtype, into shared memory
    dq       += Gqᵀ · K_blk  (fp32, in registers for the whole walk; times ``max|ds| · w[h]``
             at the end)
    dk       Gk · Q [block_I, D] (fp32), each row times its ``dscores · max|w|``, staged in
             shared memory and added to the fp32 ``dk_idx`` with 16-byte atomics

``k`` need not be a multiple of ``block_I`` (the slots past it are invalid).  The gathers are
pipelined as the forward's: ``num_stages`` buffers, one cp.async group per iteration.

Why the operands are normalized
-------------------------------
``G = dscores · w · mask`` is tiny in training: the KL loss's ``dscores`` are about
``coeff / (rows · k)`` (1e-10 at DeepSeek sizes), and ``w`` carries ``(H · D) ** -0.5``.  In
fp16, a tensor-core operand below 6e-5 loses precision and below 6e-8 is zero, so rounding
``G`` itself would lose the gradient.  Instead each CTA first finds ``max|dscores|`` over its
row's valid slots and ``max|w|`` over its heads (one pass over the row: 16 KiB of reads
against the 512 KiB of gathers), and the operands are ``ŝ = dscores / max|dscores|`` and ``ŵ =
w / max|w|``: the largest entry is exactly 1 in magnitude, so the rounding error of every
entry is relative to the row's own scale, whatever it is (bf16 needs it less: its range is
fp32's, but one rule serves both).  The two factors come back in fp32 after the products.
A row whose maxima are 0 has zero operands (and zero gradients).

The scatter into dk_idx: atomics, not a deterministic scheme
------------------------------------------------------------
A deterministic dk_idx needs every key's list of (token, slot) pairs (a sort of the indices)
and a second pass that recomputes S and G per pair, re-reading a ``[H, D]`` q tile for each:
far more traffic than the atomics.  Instead each CTA adds its fp32 rows into an fp32
``dk_idx`` that the caller zeroes and casts to the data dtype.  Each add rounds in fp32, in an
order the scheduler picks: two runs differ by fp32 reordering error, at most ``(n - 1) · 2⁻²⁴
· Σ|terms|`` for a key selected by ``n`` tokens (first order), and after the cast by that plus
one unit in the last place of the data dtype.  dq_idx and dw are deterministic (each CTA owns
its token's rows).

HBM bytes per call (T tokens, H = 64, D = 128, k = 2048, bf16)
-------------------------------------------------------------
Read: q_idx ``T · H · D · 2`` (16 KiB a token), w ``T · H · 4``, indices and dscores ``2 · T · k
· 4`` (16 KiB a token; the maxima's pass reads them once more, mostly from L2), k_idx once
(the gathers, 512 KiB a token, come from L2).  Written: dq_idx ``T · H · D · 2``, dw ``T · H · 4``.
The atomics add ``T · k · D · 4`` bytes (1 MiB a token) into the fp32 dk_idx (``T · D · 4``: 4
MiB at T = 8192, L2-resident), which the op zeroes, reads and casts (``T · D · 10`` bytes).
About 50 KiB a token of HBM traffic (400 MiB at T = 8192), against three products of ``T · k ·
H · D`` multiply-adds (4.1e11 at T = 8192) and 8 GiB of L2 atomics at T = 8192: the atomics
and the products bound the kernel.  Shared memory (:func:`smem_bytes`): q 16 KiB, two row
buffers 32 KiB, the operands 16 KiB, the fp32 staging 32 KiB: about 98 KiB, two CTAs per SM.

Self-contained on purpose: the disk cache keys a kernel on its own module's source (and
csrc_tl's shared files), so no code that emits TIR comes from the forward's module.

Signature (caller-allocated outputs; T and K = k symbolic)::

    dsa_indexer_bwd(q_idx, k_idx, w, indices, dscores, dq_idx, dk_idx, dw)

q_idx [T, H, D] dtype; k_idx [T, D] dtype; w [T, H] fp32; indices [T, K] int32; dscores
[T, K] fp32; dq_idx [T, H, D] dtype; dk_idx [T, D] fp32, zeroed by the caller (accumulated
into); dw [T, H] fp32.  All contiguous, q_idx and k_idx 16-byte aligned (cp.async).  The op
``dsa::indexer_bwd`` launches it on CUDA where :func:`config_for` names a variant (the
forward's rule; ``torch_dplr/dsa/ops/indexer.py``).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals at definition time.
import itertools

import tilelang.language as T

from .compile import canonical_dtype, kernel_options
# which configs exist (not what a config emits): the backward runs wherever the forward does
from .dsa_indexer_fwd import DIMS, DTYPES, config_for

__all__ = ["dsa_indexer_bwd_kernel", "config_for", "smem_bytes", "variants", "ref_program",
           "DIMS", "DTYPES"]

_ACC = "float32"
_MIN_NORMAL = 1.1754943508222875e-38  # the smallest normal fp32
_VEC = 8  # elements per 16-byte cp.async (2-byte dtypes)
_SMEM_LIMIT = 232_448  # dynamic shared memory per CTA on sm_90 (227 KiB)
_SMEM_MARGIN = 4096  # TileLang's alignment and headroom, as in the forward

# As the forward: no producer / consumer split, no TMA, and every barrier written out (the
# automatic pass would add ones the loop's barriers already cover).
_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True,
                 "tl.disable_thread_storage_sync": True}


def smem_bytes(H: int, D: int, block_I: int = 64, num_stages: int = 2, threads: int = 256) -> int:
    """Shared memory of the kernel (2-byte data, before TileLang's alignment): q, the staged
    rows, the two operand tiles, the fp32 staging tile of dk, the staged keys and dscores, w,
    the maxima's partial results."""
    tiles = H * D + num_stages * block_I * D + 2 * block_I * H
    return 2 * tiles + 4 * (block_I * D + 2 * num_stages * block_I + H + 2 * threads // 32)


def _check_config(H, D, dtype, block_I, num_stages, threads):
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if H % 16 or not 16 <= H <= 128:  # a GEMM's N and K: multiples of 16 heads
        raise ValueError(f"H_idx={H}: a multiple of 16 in [16, 128]")
    if D % 64 or not 64 <= D <= 256:
        raise ValueError(f"D_idx={D}: a multiple of 64 in [64, 256]")
    if H > D:  # dw's column sums are staged in the dk tile's columns
        raise ValueError(f"H_idx={H} > D_idx={D}")
    if H > threads:  # one thread per head sums dw
        raise ValueError(f"H_idx={H} > threads={threads}")
    if block_I not in (64, 128):
        raise ValueError(f"block_I={block_I}: 64 or 128 slots per block")
    if num_stages not in (1, 2, 3):
        raise ValueError(f"num_stages={num_stages}: 1 (no prefetch), 2 or 3")
    if threads not in (128, 256):
        raise ValueError(f"threads={threads}: one or two warpgroups (128 or 256)")
    # fp32 tiles per thread: S, dw (block_I x H), dq (H x D) and dk (block_I x D)
    regs = (2 * block_I * H + H * D + block_I * D) // threads
    if regs > 160:
        raise ValueError(f"block_I={block_I}, H_idx={H}, D_idx={D}, threads={threads}: the fp32 "
                         f"tiles need {regs} registers per thread (> 160)")
    size = smem_bytes(H, D, block_I, num_stages, threads)
    if size + _SMEM_MARGIN > _SMEM_LIMIT:
        raise ValueError(f"H_idx={H}, D_idx={D}, block_I={block_I}, num_stages={num_stages}: "
                         f"{size} bytes of shared memory, more than {_SMEM_LIMIT} - "
                         f"{_SMEM_MARGIN}")


@kernel_options(pass_configs=_PASS_CONFIGS)
def dsa_indexer_bwd_kernel(H: int, D: int, dtype: str, block_I: int = 64, num_stages: int = 2,
                           threads: int = 256):
    """prim_func ``dsa_indexer_bwd(q_idx, k_idx, w, indices, dscores, dq_idx, dk_idx, dw)`` for
    one config (signature in the module docstring).

    H / D / dtype: as the forward's factory (the same configs, :func:`config_for`).  Schedule
    knobs (same results up to summation order): block_I (slots per block, 64 or 128),
    num_stages (gathered blocks in flight, 1 to 3), threads (128 or 256).
    """
    dtype = canonical_dtype(dtype)
    _check_config(H, D, dtype, block_I, num_stages, threads)
    f32 = _ACC
    BI, NS = block_I, num_stages
    NW = threads // 32
    per_row = D // _VEC
    wide = T.GemmWarpPolicy.FullRow  # warps split N when M is one warpgroup's 64 rows or less

    Tn, K = T.dynamic("T, K")

    @T.macro
    def gather_block(k_idx, indices, dscores, t, blk, buf, k_s, keys_s, ds_s):
        """Write block ``blk``'s keys (-1: invalid) and dscores (0 on invalid slots) into
        buffer ``buf``, and issue its k_idx rows there by cp.async (invalid slots
        zero-filled).  Commits nothing."""
        for j in T.Parallel(BI):
            slot = blk * BI + j
            key = T.if_then_else(slot < K, indices[t, T.min(slot, K - 1)], -1)
            ok = (key >= 0) and (key < Tn)
            keys_s[buf, j] = T.if_then_else(ok, key, -1)
            # a select: whatever an invalid slot's dscores holds (NaN included) is dropped
            ds_s[buf, j] = T.if_then_else(ok, dscores[t, T.min(slot, K - 1)], T.float32(0))
        tx = T.get_thread_binding()
        for step in T.unroll(T.ceildiv(BI * per_row, threads)):
            flat = step * threads + tx
            r = flat // per_row
            col = (flat % per_row) * _VEC
            if flat < BI * per_row:
                slot = blk * BI + r
                key = T.if_then_else(slot < K, indices[t, T.min(slot, K - 1)], -1)
                ok = (key >= 0) and (key < Tn)
                T.ptx_cp_async(
                    T.access_ptr(k_s[buf, r, col], "w", _VEC),
                    T.access_ptr(k_idx[T.if_then_else(ok, key, 0), col], "r", _VEC),
                    _VEC,
                    predicate=ok,
                )

    @T.prim_func
    def dsa_indexer_bwd(
        q_idx: T.Tensor((Tn, H, D), dtype),
        k_idx: T.Tensor((Tn, D), dtype),
        w: T.Tensor((Tn, H), f32),
        indices: T.Tensor((Tn, K), "int32"),
        dscores: T.Tensor((Tn, K), f32),
        dq_idx: T.Tensor((Tn, H, D), dtype),
        dk_idx: T.Tensor((Tn, D), f32),
        dw: T.Tensor((Tn, H), f32),
    ):
        with T.Kernel(Tn, threads=threads) as bx:
            t = T.alloc_var("int32", init=bx)
            tx = T.get_thread_binding()
            lane = T.alloc_var("int32", init=tx % 32)
            warp = T.alloc_var("int32", init=tx // 32)

            q_s = T.alloc_shared((H, D), dtype)
            k_s = T.alloc_shared((NS, BI, D), dtype)
            keys_s = T.alloc_shared((NS, BI), "int32")
            ds_s = T.alloc_shared((NS, BI), f32)
            w_s = T.alloc_shared((H,), f32)
            gq_s = T.alloc_shared((BI, H), dtype)  # ŝ · [S > 0]: dq's operand
            gk_s = T.alloc_shared((BI, H), dtype)  # ŵ · [S > 0]: dk's operand
            stage_s = T.alloc_shared((BI, D), f32)  # dk rows for the atomics; dw at the end
            part_s = T.alloc_shared((2, NW), f32)  # per warp: max|dscores|, max|w|

            acc_s = T.alloc_fragment((BI, H), f32)
            acc_dw = T.alloc_fragment((BI, H), f32)
            acc_dq = T.alloc_fragment((H, D), f32)
            acc_dk = T.alloc_fragment((BI, D), f32)

            big_ds = T.alloc_var(f32)  # max|dscores| over the row's valid slots
            big_w = T.alloc_var(f32)  # max|w| over the token's heads
            inv_ds = T.alloc_var(f32)
            inv_w = T.alloc_var(f32)
            dw_sum = T.alloc_var(f32)

            n_blocks = T.ceildiv(K, BI)

            T.async_copy(q_idx[t, :, :], q_s)  # its own commit group, the oldest
            for h in T.Parallel(H):
                w_s[h] = w[t, h]

            # the row's scales: each thread's slots, then the warp, then the warps (below)
            big_ds = T.float32(0)
            for m in T.serial(T.ceildiv(K, threads)):
                slot = m * threads + tx
                if slot < K:
                    key = indices[t, slot]
                    if key >= 0 and key < Tn:
                        big_ds = T.max(big_ds, T.abs(dscores[t, slot]))
            big_w = T.if_then_else(tx < H, T.abs(w[t, T.min(tx, H - 1)]), T.float32(0))
            big_ds = T.warp_reduce_max(big_ds)
            big_w = T.warp_reduce_max(big_w)
            if lane == 0:
                part_s[0, warp] = big_ds
                part_s[1, warp] = big_w

            if NS > 1:
                for b in T.unroll(NS - 1):  # the first num_stages - 1 blocks, a group each
                    if b < n_blocks:
                        gather_block(k_idx, indices, dscores, t, b, b, k_s, keys_s, ds_s)
                    T.ptx_commit_group()
            T.sync_threads()  # part_s and w_s written
            big_ds = T.float32(0)
            big_w = T.float32(0)
            for r in T.unroll(NW):
                big_ds = T.max(big_ds, part_s[0, r])
                big_w = T.max(big_w, part_s[1, r])
            # normalizers only above the smallest normal fp32: 1 / a subnormal is inf, and
            # 0 · inf a NaN (a row whose largest |dscore| is subnormal gets zero gradients)
            inv_ds = T.if_then_else(big_ds >= _MIN_NORMAL, T.float32(1) / big_ds,
                                    T.float32(0))
            inv_w = T.if_then_else(big_w >= _MIN_NORMAL, T.float32(1) / big_w, T.float32(0))

            T.fill(acc_dw, 0)
            T.fill(acc_dq, 0)
            for i in T.serial(n_blocks):
                cur = i % NS
                ahead = i + NS - 1
                # every thread is done with block i - 1: its row buffer, the operand tiles and
                # the staging tile (the atomics' reads) are free
                T.sync_threads()
                if ahead < n_blocks:
                    gather_block(k_idx, indices, dscores, t, ahead, ahead % NS, k_s, keys_s,
                                 ds_s)
                T.ptx_commit_group()  # one group per iteration, empty past the last block
                T.ptx_wait_group(NS - 1)  # block i's group (and every older one) has landed
                T.sync_threads()  # ... from every thread, with its keys and dscores

                T.gemm(k_s[cur, :, :], q_s, acc_s, transpose_B=True, clear_accum=True,
                       policy=wide)
                for r, h in T.Parallel(BI, H):
                    x = acc_s[r, h]
                    ds = ds_s[cur, r]
                    # ReLU as torch.relu (a NaN product stays NaN); its gradient is [x > 0]
                    acc_dw[r, h] += ds * T.if_then_else(x < T.float32(0), T.float32(0), x)
                    gq_s[r, h] = T.Cast(dtype, T.if_then_else(x > T.float32(0), ds * inv_ds,
                                                              T.float32(0)))
                    gk_s[r, h] = T.Cast(dtype, T.if_then_else(x > T.float32(0),
                                                              w_s[h] * inv_w, T.float32(0)))
                T.sync_threads()  # the operand tiles are complete

                T.gemm(gq_s, k_s[cur, :, :], acc_dq, transpose_A=True, policy=wide)
                T.gemm(gk_s, q_s, acc_dk, clear_accum=True, policy=wide)
                for r, d in T.Parallel(BI, D):
                    stage_s[r, d] = acc_dk[r, d] * (ds_s[cur, r] * big_w)
                T.sync_threads()  # the staged rows are complete
                for r, c in T.Parallel(BI, D // 4):
                    if keys_s[cur, r] >= 0:
                        T.atomic_addx4(dk_idx[keys_s[cur, r], c * 4], stage_s[r, c * 4])

            T.ptx_wait_group(0)  # k = 0: q's group was never waited for
            T.sync_threads()  # the last atomics have read the staging tile; q landed
            for h, d in T.Parallel(H, D):
                dq_idx[t, h, d] = T.Cast(dtype, acc_dq[h, d] * (w_s[h] * big_ds))
            for r, h in T.Parallel(BI, H):
                stage_s[r, h] = acc_dw[r, h]
            T.sync_threads()  # every slot's dw terms staged
            if tx < H:
                dw_sum = T.float32(0)
                for r in T.serial(BI):
                    dw_sum = dw_sum + stage_s[r, tx]
                dw[t, tx] = dw_sum

    return dsa_indexer_bwd


def variants():
    """Every config the op builds: the forward's (each (H_idx, D_idx) of :data:`DIMS` x
    dtype), default schedule."""
    for (H, D), dt in itertools.product(DIMS, DTYPES):
        yield dict(H=H, D=D, dtype=dt)


def ref_program(q_idx, k_idx, w, indices, dscores):
    """The contract: the op's PyTorch kernel (fp32 math), ``(dq_idx, dk_idx, dw)``."""
    from torch_dplr.dsa.ops.indexer import indexer_bwd_reference

    return indexer_bwd_reference(q_idx, k_idx, w, indices, dscores)
