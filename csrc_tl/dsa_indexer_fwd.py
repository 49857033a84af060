"""Lightning-indexer scores at selected keys (``dsa::indexer_fwd``): per query token, the
index score of each of its ``k`` selected keys, gathered by index.

Contract (``torch_dplr.dsa.reference.indexer``, see :func:`ref_program`)::

    scores[t, j] = Σ_h w[t, h] · ReLU(q_idx[t, h] · k_idx[indices[t, j]])     (valid slots)
    scores[t, j] = -inf                                                     (the others)

A slot is valid when its index lies in ``[0, T)``: ``-1`` (the top-k op's empty slot) and any
other out-of-range value give ``-inf`` and are never read (the PyTorch kernel rejects an
out-of-range index with a host read; the CUDA op reads none and relies on this).  Indices may
come in any order.  Scores are fp32: bf16 / fp16 products accumulated in fp32 by the tensor
cores, ReLU as ``torch.relu`` (a NaN product stays NaN), times fp32 ``w``, summed over the
heads in fp32: the reference's sum in another order (equal to it wherever the partial sums
are exact, as with small integer inputs).

Grid and tiles
--------------
One CTA per query token (a 1-D grid of T CTAs: no 65535 limit).  The CTA keeps its token's
``q_idx [H, D]`` and ``w [H]`` in shared memory and walks its slots in blocks of ``block_I``:

    gather   the block's k_idx rows into shared memory by cp.async, 16 bytes per thread and
             instruction, predicated on the slot's validity (an invalid slot's row is
             zero-filled), and the block's keys (-1: invalid) next to them
    S        K_blk [block_I, D] · Q [H, D]ᵀ on the tensor cores (fp32 accumulator; wgmma, one
             warpgroup's M = 64 slots, N = the H heads)
    scores   ReLU(S) · w, summed over each slot's H heads (``T.reduce_sum`` over the row:
             across warps through shared memory where the heads are split over warps), written
             for the slots below ``k`` (-inf for the invalid ones)

The slots are the GEMM's M so that the head sum is a row reduction, and every block of a
token reuses one q tile.  Different tokens select different keys, so a CTA shares no gathered
row with another; the CTAs of neighbouring tokens, which select mostly the same keys, meet in
L2 (k_idx is ``T · D · 2`` bytes: 2 MiB at T = 8192, 8 MiB at 32768, L2-resident).

Pipeline
--------
``num_stages`` buffers of gathered rows (default 2): block i + num_stages - 1 is gathered
while block i computes.  Every iteration commits exactly one cp.async group (an empty one past
the last block), so ``wait_group(num_stages - 1)`` always means "block i has landed" (q's
group, committed first, with it).  A CTA barrier before each gather (its buffer's last
readers, block i - 1's GEMM and head sum, are synchronous) and one after the wait.  ``k`` need
not be a multiple of ``block_I``: the slots past it are invalid and not written.

HBM bytes per call (T tokens, H = 64, D = 128, k = 2048, bf16)
-------------------------------------------------------------
Read: q_idx ``T · H · D · 2`` (16 KiB a token), w ``T · H · 4``, indices ``T · k · 4`` (8 KiB a
token), k_idx once (the gathers, ``T · k · D · 2`` = 512 KiB a token, come from L2).  Written:
scores ``T · k · 4`` (8 KiB a token).  About 33 KiB a token: 264 MiB at T = 8192 (~65 µs at
4.3 TB/s), against ``T · k · H · D`` multiply-adds (1.4e11 at T = 8192, ~0.35 ms at the bf16
tensor-core peak) and 4 GiB of L2 gathers: the kernel is bound by the products and the
gathers, not HBM.  Shared memory (:func:`smem_bytes`): q 16 KiB plus 16 KiB per stage: about
49 KiB at two stages, four CTAs per SM.

Accumulation and determinism: fp32 throughout, no atomics, every sum in a fixed order: the
result is deterministic.

Signature (caller-allocated output; T and K = k symbolic)::

    dsa_indexer_fwd(q_idx, k_idx, w, indices, scores)

q_idx [T, H, D] dtype; k_idx [T, D] dtype; w [T, H] fp32; indices [T, K] int32; scores [T, K]
fp32.  All contiguous, q_idx and k_idx 16-byte aligned (cp.async).  The op
``dsa::indexer_fwd`` launches it on CUDA where :func:`config_for` names a variant
(``torch_dplr/dsa/ops/indexer.py``).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals at definition time.
import itertools

import tilelang.language as T

from .compile import canonical_dtype, kernel_options

__all__ = ["dsa_indexer_fwd_kernel", "config_for", "smem_bytes", "variants", "ref_program",
           "DIMS", "DTYPES"]

#: (H_idx, D_idx) pairs built: DeepSeek-V3.2's indexer (64 heads of 128) and a smaller one
#: (the top-k kernel's two).
DIMS = ((64, 128), (32, 64))
DTYPES = ("bfloat16", "float16")

_ACC = "float32"
_VEC = 8  # elements per 16-byte cp.async (2-byte dtypes)
_SMEM_LIMIT = 232_448  # dynamic shared memory per CTA on sm_90 (227 KiB)
_SMEM_MARGIN = 4096  # TileLang's alignment and headroom (see dsa_sparse_mla_fwd)

# Warp specialization off (no producer / consumer split: the loads are explicit cp.async);
# TMA off: with symbolic shapes its descriptors would be encoded on the host at every launch.
# Barriers by hand: the automatic pass adds one between a block's key writes and its gather
# (it does not see that the loop's first barrier already orders them); the two barriers the
# loop needs are written out and say what they order.
_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True,
                 "tl.disable_thread_storage_sync": True}


def smem_bytes(H: int, D: int, block_I: int = 64, num_stages: int = 2, threads: int = 128) -> int:
    """Shared memory of the kernel (2-byte data, before TileLang's alignment): q, the staged
    rows and their keys, w, and the head sum's cross-warp scratch."""
    return 2 * (H * D + num_stages * block_I * D) + 4 * (num_stages * block_I + H + threads)


def _check_config(H, D, dtype, block_I, num_stages, threads):
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if H % 16 or not 16 <= H <= 128:  # the GEMM's N: a multiple of 16 heads per warpgroup
        raise ValueError(f"H_idx={H}: a multiple of 16 in [16, 128]")
    if D % 64 or not 64 <= D <= 256:  # whole 128-byte rows for the gathers and the swizzle
        raise ValueError(f"D_idx={D}: a multiple of 64 in [64, 256]")
    if block_I not in (64, 128):  # one or two wgmma M tiles
        raise ValueError(f"block_I={block_I}: 64 or 128 slots per block")
    if num_stages not in (1, 2, 3):
        raise ValueError(f"num_stages={num_stages}: 1 (no prefetch), 2 or 3")
    if threads not in (128, 256):
        raise ValueError(f"threads={threads}: one or two warpgroups (128 or 256)")
    if block_I * H // threads > 64:  # the fp32 S tile's registers per thread
        raise ValueError(f"block_I={block_I}, H_idx={H}, threads={threads}: the fp32 S tile "
                         f"needs {block_I * H // threads} registers per thread (> 64)")
    size = smem_bytes(H, D, block_I, num_stages, threads)
    if size + _SMEM_MARGIN > _SMEM_LIMIT:
        raise ValueError(f"H_idx={H}, D_idx={D}, block_I={block_I}, num_stages={num_stages}: "
                         f"{size} bytes of shared memory, more than {_SMEM_LIMIT} - "
                         f"{_SMEM_MARGIN}")


@kernel_options(pass_configs=_PASS_CONFIGS)
def dsa_indexer_fwd_kernel(H: int, D: int, dtype: str, block_I: int = 64, num_stages: int = 2,
                           threads: int = 128):
    """prim_func ``dsa_indexer_fwd(q_idx, k_idx, w, indices, scores)`` for one config
    (signature in the module docstring).

    H / D: index heads and head dim; dtype: bf16 / fp16 q_idx and k_idx.  Schedule knobs (same
    results up to the head sum's order): block_I (slots per block, 64 or 128), num_stages
    (gathered blocks in flight, 1 to 3), threads (128 or 256).
    """
    dtype = canonical_dtype(dtype)
    _check_config(H, D, dtype, block_I, num_stages, threads)
    f32 = _ACC
    BI, NS = block_I, num_stages
    per_row = D // _VEC  # 16-byte chunks per gathered row

    Tn, K = T.dynamic("T, K")

    @T.macro
    def gather_block(k_idx, indices, t, blk, buf, k_s, keys_s):
        """Write block ``blk``'s keys (-1: invalid) into ``keys_s[buf]`` and issue its k_idx
        rows into buffer ``buf`` by cp.async (invalid slots zero-filled).  Commits nothing."""
        for j in T.Parallel(BI):
            slot = blk * BI + j
            key = T.if_then_else(slot < K, indices[t, T.min(slot, K - 1)], -1)
            keys_s[buf, j] = T.if_then_else((key >= 0) and (key < Tn), key, -1)
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
    def dsa_indexer_fwd(
        q_idx: T.Tensor((Tn, H, D), dtype),
        k_idx: T.Tensor((Tn, D), dtype),
        w: T.Tensor((Tn, H), f32),
        indices: T.Tensor((Tn, K), "int32"),
        scores: T.Tensor((Tn, K), f32),
    ):
        with T.Kernel(Tn, threads=threads) as bx:
            t = T.alloc_var("int32", init=bx)

            q_s = T.alloc_shared((H, D), dtype)
            k_s = T.alloc_shared((NS, BI, D), dtype)
            keys_s = T.alloc_shared((NS, BI), "int32")
            w_s = T.alloc_shared((H,), f32)

            acc = T.alloc_fragment((BI, H), f32)
            row_sum = T.alloc_fragment((BI,), f32)

            n_blocks = T.ceildiv(K, BI)

            T.async_copy(q_idx[t, :, :], q_s)  # its own commit group, the oldest
            for h in T.Parallel(H):
                w_s[h] = w[t, h]
            if NS > 1:
                for b in T.unroll(NS - 1):  # the first num_stages - 1 blocks, a group each
                    if b < n_blocks:
                        gather_block(k_idx, indices, t, b, b, k_s, keys_s)
                    T.ptx_commit_group()

            for i in T.serial(n_blocks):
                cur = i % NS
                ahead = i + NS - 1
                # every thread is done with block i - 1, whose buffer the gather below refills
                T.sync_threads()
                if ahead < n_blocks:
                    gather_block(k_idx, indices, t, ahead, ahead % NS, k_s, keys_s)
                T.ptx_commit_group()  # one group per iteration, empty past the last block
                T.ptx_wait_group(NS - 1)  # block i's group (and every older one) has landed
                T.sync_threads()

                T.gemm(k_s[cur, :, :], q_s, acc, transpose_B=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullRow)
                # ReLU as torch.relu: a NaN product stays NaN (fmaxf would give 0)
                for r, h in T.Parallel(BI, H):
                    x = acc[r, h]
                    acc[r, h] = T.if_then_else(x < T.float32(0), T.float32(0), x) * w_s[h]
                T.reduce_sum(acc, row_sum, dim=1)
                for r in T.Parallel(BI):
                    slot = i * BI + r
                    if slot < K:
                        scores[t, slot] = T.if_then_else(keys_s[cur, r] >= 0, row_sum[r],
                                                         -T.infinity(f32))

            T.ptx_wait_group(0)  # k = 0 (or a short row): groups never waited for

    return dsa_indexer_fwd


def variants():
    """Every config the op builds (:func:`config_for`): each (H_idx, D_idx) of :data:`DIMS` x
    dtype, default schedule."""
    for (H, D), dt in itertools.product(DIMS, DTYPES):
        yield dict(H=H, D=D, dtype=dt)


def config_for(H: int, D: int, dtype) -> dict | None:
    """The variant a call runs (a ``variants()`` entry), or None where none is built (the
    backward, ``csrc_tl.dsa_indexer_bwd``, shares the rule)."""
    name = str(dtype).removeprefix("torch.")
    if (H, D) not in DIMS or name not in DTYPES:
        return None
    return dict(H=H, D=D, dtype=name)


def ref_program(q_idx, k_idx, w, indices):
    """The contract: the op's PyTorch kernel (fp32 math), ``scores``."""
    from torch_dplr.dsa.ops.indexer import indexer_fwd_reference

    return indexer_fwd_reference(q_idx, k_idx, w, indices)
