"""Indexer KL loss forward (``dsa::indexer_loss_fwd``): the head-averaged main attention over
each query's selected keys (the KL's target ``p``) and each row's KL against the indexer's
softmax, in one kernel, without per-head probabilities ever leaving the SM.

Contract (``torch_dplr.dsa.reference.loss``, see :func:`ref_program`)::

    u[t, j]    = Σ_h exp(scale · q[t, h] · kv[indices[t, j]] - lse[t, h]) / H   (gathered slots)
    p[t, j]    = u[t, j] / max(Σ_j u[t, j], 1e-10)                             (``target``)
    log_q[t]   = log_softmax(scores[t, j] over the row's valid slots)
    KL[t]      = Σ_j p · (log max(p, 1e-10) - log_q)                            (valid slots)
    rows[t]    = (KL[t], 1 if row t has a valid slot else 0)

A slot is valid when its index lies in ``[0, T_kv)``: the kernel never reads outside kv, and an
index at or past ``T_kv`` is an empty slot, as in the sparse MLA and indexer kernels (whose
score kernel writes -inf there); the PyTorch kernel rejects such indices with a host read, the
CUDA op reads none.  ``lse`` is
the sparse attention's own (``dsa::sparse_mla_fwd``), so ``exp(logit - lse)`` is each head's
probability without a second pass.  A row without a valid slot (padding tokens, whose indices
are all -1) gets ``p = 0`` and ``rows[t] = (0, 0)``.  The op turns ``rows`` into the loss:
``coeff · Σ_t KL[t]``, divided by ``max(Σ_t rows[t, 1], 1)`` for ``"mean"`` (a PyTorch sum
over ``[T, 2]``: deterministic, no atomics anywhere).

Grid and tiles
--------------
One CTA per query token (the last token first: later tokens of a sequence select more keys),
``threads`` = 256, holding all of the token's heads: ``q [heads, D_qk]`` (``heads`` = 64 or
128, rows past ``H`` zero-filled) stays in shared memory for the whole row, so every
selected kv row is gathered once per token (a CTA per head block would gather it once per
block).  The CTA runs:

    scan     one pass over the row's indices and scores, each thread a strided share: the
             last gathered slot (the slot loop stops at its block: top-k rows end in -1
             tails), whether any slot is valid, and the scores' log-sum-exp over the valid
             slots (per thread an online max and sum, combined per warp by shuffles and
             across warps in shared memory in a fixed order)
    slots    blocks of ``block_I`` slots: gather the kv rows by predicated cp.async (an
             invalid slot's row is zero-filled), ``S = kv_blk · qᵀ`` on the tensor cores
             (``[block_I slots, heads]`` fp32: the slots are the GEMM's M, so the head sum is
             a row reduction inside a warp or warpgroup pair), ``P = 2^(S · scale · log2 e -
             lse · log2 e)`` (a padded head has ``lse = +inf``: P = 0), masked to the block's
             gathered slots, summed over heads, divided by H and stored as ``u``
    tail     the sum of ``u`` (the blocks' per-slot sums, reduced once), then one strided
             pass over the row: ``p = u / max(sum, 1e-10)`` read back (the CTA's own stores,
             ordered by a barrier) and written over ``u`` for every slot, and the KL terms,
             summed as in the scan; one thread writes ``rows[t]``

Pipeline: each block's kv tile is ``D_qk / chunk`` column chunks, and the ring holds
``num_stages`` tiles of chunks, one cp.async commit group per chunk (an empty group where a
block does not exist, so the count stays uniform).  The GEMM runs chunk by chunk; right after
chunk c of block i (a barrier: every warp's synchronous GEMM is done with it) the same buffer
is refilled with chunk c of block ``i + num_stages``, and ``wait_group(ring - 1)`` before a
chunk's GEMM lets the other ``ring - 1`` chunks stay in flight.  At D_qk = 576 with 128 heads
q alone is 144 KiB, so one 64-slot tile in three 192-column chunks keeps two chunks (48 KiB)
landing during each chunk's GEMM; with fewer heads or a smaller D_qk the ring holds two whole
tiles.  The block's slot mask goes to shared memory behind the barrier of its first chunk.

Bytes per call (DeepSeek-V3.2: T = 8192, H = 128, D_qk = 576, k = 2048, bf16)
------------------------------------------------------------------------------
HBM reads: q once, ``T · H · D_qk · 2`` = 1.21 GB (the bulk: each token's heads are read by
its one CTA); kv ``T_kv · D_qk · 2`` = 9.4 MB (L2-resident; the gathers move
``T · k · D_qk · 2`` = 19 GB from L2 to the SMs); lse 4 MB; indices and scores
``T · k · 4`` = 64 MiB each, read by the scan (the gathers' and the tail's second reads hit
L1 / L2).  Writes: ``target`` 64 MiB (stored as ``u``, then once more as ``p``: the second
store usually meets the first in L2) and ``rows`` 64 KiB.  About 1.5 GB in all, against
``T · k · H · D_qk`` = 1.24e12 multiply-adds: the kernel is bound by the tensor cores.  No
workspace: the op's peak memory is the ``[T, k]`` target (``O(T · k)``), never a
``[T, H, k]`` tensor.

Numerics and determinism
------------------------
Products in fp32 on the tensor cores (bf16 / fp16 operands, as the inputs), exponentials in
log2 units (``exp2``), every sum in fp32; the scores' softmax in natural units as the
reference (``exp``, ``log``, the ``1e-10`` floor in ``log p``, ``log`` of the sum clamped at
the smallest normal).  The results differ from the PyTorch kernel by fp32 summation order and
the rounding of the log2-unit exponents.  No atomics: every sum has a fixed order (per-thread strided partials, shuffle trees,
warps in order), so two runs are bit-for-bit equal.

Shared memory (:func:`smem_bytes`): q, the kv ring, the slot mask, the heads' ``-lse · log2 e``
and the reductions' scratch; every built config stays :data:`_SMEM_MARGIN` under the sm_90
per-CTA limit (216 KiB of tiles at D_qk 576 with 128 heads, one CTA per SM).  Registers: the
``[block_I, heads]`` fp32 S tile is 32 per thread in every default config.  With 64 slots and
128 heads the two warpgroups split the heads (their head sums meet in shared memory), with
128 slots and 64 heads they split the slots.

Signature (caller-allocated outputs; T, T_kv, H and K = k symbolic)::

    dsa_indexer_loss(q, kv, indices, lse, scores, scale, target, rows)

q [T, H, D_qk] dtype; kv [T_kv, D_qk] dtype; indices [T, K] int32; lse [T, H] fp32; scores
[T, K] fp32; scale float; target [T, K] fp32; rows [T, 2] fp32.  q and kv contiguous and
16-byte aligned (cp.async).  The op ``dsa::indexer_loss_fwd`` launches it on CUDA where
:func:`config_for` names a variant (``torch_dplr/dsa/ops/loss.py``).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals at definition time.
import tilelang.language as T

from .compile import canonical_dtype, kernel_options
from .tile_macros import LOG2E

__all__ = ["dsa_indexer_loss_kernel", "config_for", "default_schedule", "smem_bytes",
           "variants", "ref_program", "HEADS", "DTYPES", "EPS", "MAX_HEADS"]

#: Heads per CTA built for each D_qk: DeepSeek-V3.2's 576 (512 latent + 64 rope) with 64 or
#: 128 heads, two test sizes with 128.  A call's H is padded to the smallest that holds it.
HEADS = {576: (64, 128), 192: (128,), 64: (128,)}
DTYPES = ("bfloat16", "float16")
MAX_HEADS = 128
EPS = 1e-10  # the floor under p inside the log (torch_dplr.dsa.reference.loss.EPS)

_ACC = "float32"
_VEC = 8  # elements per 16-byte cp.async (2-byte dtypes)
_UNROLL = 8  # slots per thread whose loads a strided pass issues together
_TINY = 1.1754943508222875e-38  # the smallest normal fp32: the reference's clamp under log Z
_SMEM_LIMIT = 232_448  # dynamic shared memory per CTA on sm_90 (227 KiB)
_SMEM_MARGIN = 4096  # TileLang's alignment and headroom (see dsa_sparse_mla_fwd)

# Warp specialization off (the loads are explicit cp.async groups, not a producer / consumer
# split); TMA off: with symbolic shapes its descriptors would be encoded at every launch.
_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True}


def smem_bytes(D_qk: int, heads: int, block_I: int, num_stages: int, threads: int = 256) -> int:
    """Shared memory of the kernel (2-byte data) before TileLang's alignment: q, the kv ring,
    the slot mask, ``-lse · log2 e`` per head, the block reductions' scratch and the head
    sum's (fp32 per thread, where two warpgroups split the heads)."""
    tiles = 2 * (heads * D_qk + num_stages * block_I * D_qk)
    return tiles + 4 * (block_I + heads + 8 * (threads // 32) + 2 * threads)


def _fits(D_qk, heads, block_I, num_stages, threads=256) -> bool:
    return smem_bytes(D_qk, heads, block_I, num_stages, threads) + _SMEM_MARGIN <= _SMEM_LIMIT


def default_schedule(D_qk: int, heads: int) -> dict:
    """``block_I``, ``chunk``, ``num_stages`` by default: 128 slots where the heads are 64 (the
    two warpgroups take 64 slots each), else 64; 192-column chunks where D_qk has them, else
    one chunk; two tiles in the ring where they fit, else one."""
    block_I = 128 if heads == 64 else 64
    chunk = 192 if D_qk % 192 == 0 else D_qk
    num_stages = 2 if _fits(D_qk, heads, block_I, 2) else 1
    return dict(block_I=block_I, chunk=chunk, num_stages=num_stages)


def _check_config(D_qk, dtype, heads, block_I, chunk, num_stages, threads):
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if D_qk % 64 or not 64 <= D_qk <= 1024:  # 128-byte swizzled rows of 64 columns
        raise ValueError(f"D_qk={D_qk}: need a multiple of 64 in [64, 1024]")
    if chunk % 64 or D_qk % chunk:
        raise ValueError(f"chunk={chunk}: a multiple of 64 dividing D_qk={D_qk}")
    if heads not in (64, 128):
        raise ValueError(f"heads={heads}: 64 or 128 per CTA")
    if block_I not in (64, 128):  # one or two warpgroups' wgmma M
        raise ValueError(f"block_I={block_I}: 64 or 128 slots per block")
    if num_stages not in (1, 2):
        raise ValueError(f"num_stages={num_stages}: 1 or 2 kv tiles in the ring")
    if threads != 256:
        raise ValueError(f"threads={threads}: two warpgroups (256)")
    if block_I * heads // threads > 64:
        raise ValueError(f"block_I={block_I}, heads={heads}: the fp32 S tile needs "
                         f"{block_I * heads // threads} registers per thread (> 64)")
    if not _fits(D_qk, heads, block_I, num_stages, threads):
        raise ValueError(f"D_qk={D_qk}, heads={heads}, block_I={block_I}, num_stages="
                         f"{num_stages}: {smem_bytes(D_qk, heads, block_I, num_stages, threads)}"
                         f" bytes of shared memory, more than {_SMEM_LIMIT} - {_SMEM_MARGIN}")


@kernel_options(pass_configs=_PASS_CONFIGS)
def dsa_indexer_loss_kernel(
    D_qk: int,
    dtype: str,
    heads: int = 128,
    block_I: int | None = None,
    chunk: int | None = None,
    num_stages: int | None = None,
    threads: int = 256,
):
    """prim_func ``dsa_indexer_loss(q, kv, indices, lse, scores, scale, target, rows)`` for one
    config (signature in the module docstring).

    D_qk: q / kv row width; dtype: bf16 / fp16 data; heads: heads per CTA (64 or 128, H padded
    to it).  Schedule knobs (same results up to summation order; defaults
    :func:`default_schedule`): block_I (slots per block), chunk (kv columns per cp.async group
    and GEMM step), num_stages (kv tiles in the ring).
    """
    dtype = canonical_dtype(dtype)
    schedule = default_schedule(D_qk, heads)
    block_I = schedule["block_I"] if block_I is None else block_I
    chunk = schedule["chunk"] if chunk is None else chunk
    num_stages = schedule["num_stages"] if num_stages is None else num_stages
    _check_config(D_qk, dtype, heads, block_I, chunk, num_stages, threads)
    HP, BI, W = heads, block_I, chunk
    NC = D_qk // W  # chunks per kv tile
    RING = num_stages * NC  # chunk buffers, each its own commit group
    NW = threads // 32
    f32 = _ACC
    per_row = W // _VEC
    steps = T.ceildiv(BI * per_row, threads)
    neg_inf = -T.infinity(f32)

    Tn, Tkv, H, K = T.dynamic("T, T_kv, H, K")

    def slot_value(x, t, j, past):
        """``x[t, j]`` of a ``[T, K]`` tensor, ``past`` for a slot ``j >= K`` (the row's reads
        cover whole strides and blocks): an expression, built while tracing."""
        return T.if_then_else(j < K, x[t, T.min(j, K - 1)], past)

    @T.macro
    def gather_chunk(kv, indices, t, blk, c, kv_s, buf):
        """Chunk c of block blk's kv rows into ring buffer ``buf`` by cp.async, 16 bytes per
        thread and step, invalid slots (and slots past K) zero-filled.  Neither commits nor
        waits."""
        tx = T.get_thread_binding()
        for step in T.unroll(steps):
            flat = step * threads + tx
            r = flat // per_row
            col = (flat % per_row) * _VEC
            if flat < BI * per_row:
                slot = blk * BI + r
                key = slot_value(indices, t, slot, -1)
                ok = (key >= 0) and (key < Tkv)
                T.ptx_cp_async(
                    T.access_ptr(kv_s[buf, r, col], "w", _VEC),
                    T.access_ptr(kv[T.if_then_else(ok, key, 0), c * W + col], "r", _VEC),
                    _VEC,
                    predicate=ok,
                )

    @T.macro
    def warp_partials(x, red_s, slot, lane, warp):
        """Each warp's sum of x (a shuffle tree) into ``red_s[slot, warp]``, then a barrier:
        the CTA's sum is the warps' in order (the caller adds them).  A slot is used once per
        CTA, so no later write races a read."""
        part = T.warp_reduce_sum(x)
        if lane == 0:
            red_s[slot, warp] = part
        T.sync_threads()

    @T.prim_func
    def dsa_indexer_loss(
        q: T.Tensor((Tn, H, D_qk), dtype),
        kv: T.Tensor((Tkv, D_qk), dtype),
        indices: T.Tensor((Tn, K), "int32"),
        lse: T.Tensor((Tn, H), f32),
        scores: T.Tensor((Tn, K), f32),
        scale: T.float32,
        target: T.Tensor((Tn, K), f32),
        rows: T.Tensor((Tn, 2), f32),
    ):
        with T.Kernel(Tn, threads=threads) as bx:
            tx = T.get_thread_binding()
            t = T.alloc_var("int32", init=Tn - 1 - bx)  # the last token first: the heaviest
            lane = T.alloc_var("int32", init=tx % 32)
            warp = T.alloc_var("int32", init=tx // 32)

            q_s = T.alloc_shared((NC, HP, W), dtype)
            kv_s = T.alloc_shared((RING, BI, W), dtype)
            ok_s = T.alloc_shared((BI,), f32)  # 1: the block's slot is gathered, 0: not
            nl_s = T.alloc_shared((HP,), f32)  # -lse · log2 e (-inf: a padded head)
            red_s = T.alloc_shared((3, NW), f32)  # the CTA sums' warp partials
            redi_s = T.alloc_shared((2, NW), "int32")

            acc = T.alloc_fragment((BI, HP), f32)
            p_blk = T.alloc_fragment((BI,), f32)
            u_sum = T.alloc_fragment((BI,), f32)  # Σ over blocks of u, per slot of a block
            row_u = T.alloc_fragment((1,), f32)

            key_r = T.alloc_local((_UNROLL,), "int32")  # a strided pass's loads, in flight
            score_r = T.alloc_local((_UNROLL,), f32)  # together
            u_r = T.alloc_local((_UNROLL,), f32)
            m = T.alloc_var(f32)  # the scan: this thread's running max of its valid scores,
            z = T.alloc_var(f32)  # its sum of exp(score - m),
            last = T.alloc_var("int32")  # its last gathered slot (-1: none),
            any_ok = T.alloc_var("int32")  # whether it saw a valid slot
            part_m = T.alloc_var(f32)
            m_row = T.alloc_var(f32)
            z_row = T.alloc_var(f32)
            log_z = T.alloc_var(f32)
            n_blk = T.alloc_var("int32")
            total = T.alloc_var(f32)
            kl = T.alloc_var(f32)

            c2 = scale * LOG2E  # logits in log2 units
            Hf = T.Cast(f32, H)

            # q's heads in column chunks (rows past H zero-filled), one commit group each; then
            # the first num_stages blocks, whether or not the row has them (an absent slot is
            # zero-filled, never read from kv): all in flight during the scan
            for c in T.unroll(NC):
                T.async_copy(q[t, 0:HP, c * W : (c + 1) * W], q_s[c, :, :])
            for b in T.unroll(num_stages):
                for c in T.unroll(NC):
                    gather_chunk(kv, indices, t, b, c, kv_s, b * NC + c)
                    T.ptx_commit_group()
            for h in T.Parallel(HP):
                nl_s[h] = T.if_then_else(h < H, -lse[t, T.min(h, H - 1)] * LOG2E, neg_inf)

            # scan: the last gathered slot, any valid slot, the valid scores' log-sum-exp
            m = neg_inf
            z = T.float32(0)
            last = -1
            any_ok = 0
            for r0 in T.serial(T.ceildiv(K, threads * _UNROLL)):
                for u in T.unroll(_UNROLL):
                    j = (r0 * _UNROLL + u) * threads + tx
                    key_r[u] = slot_value(indices, t, j, -1)
                    score_r[u] = slot_value(scores, t, j, T.float32(0))
                for u in T.unroll(_UNROLL):
                    if (key_r[u] >= 0) and (key_r[u] < Tkv):
                        any_ok = 1
                        last = (r0 * _UNROLL + u) * threads + tx
                        # a -inf score adds exp(-inf) = 0 (against m = -inf, score - m would
                        # be NaN); otherwise one exponential: the smaller of (score, m)
                        # against the larger
                        if score_r[u] > neg_inf:
                            d = score_r[u] - m
                            e = T.exp(-T.abs(d))
                            z = T.if_then_else(d > 0, z * e + T.float32(1), z + e)
                            m = T.max(m, score_r[u])
            # per warp: the max and the sums rescaled to it, the ints by max; then the warps
            part_m = T.warp_reduce_max(m)
            z = T.warp_reduce_sum(T.if_then_else(m == neg_inf, T.float32(0),
                                                 z * T.exp(m - part_m)))
            last = T.warp_reduce_max(last)
            any_ok = T.warp_reduce_max(any_ok)
            if lane == 0:
                red_s[0, warp] = part_m
                red_s[1, warp] = z
                redi_s[0, warp] = last
                redi_s[1, warp] = any_ok
            T.sync_threads()
            m_row = neg_inf
            last = -1
            any_ok = 0
            for w in T.unroll(NW):
                m_row = T.max(m_row, red_s[0, w])
                last = T.max(last, redi_s[0, w])
                any_ok = T.max(any_ok, redi_s[1, w])
            z_row = T.float32(0)
            for w in T.unroll(NW):
                z_row = z_row + T.if_then_else(red_s[0, w] == neg_inf, T.float32(0),
                                               red_s[1, w] * T.exp(red_s[0, w] - m_row))
            log_z = T.log(T.max(z_row, T.float32(_TINY)))
            # no finite valid score: shift by 0, as the reference (log_q = -inf, not NaN)
            m_row = T.if_then_else(m_row == neg_inf, T.float32(0), m_row)
            n_blk = T.ceildiv(last + 1, BI)  # blocks up to the last gathered slot (0: none)

            T.clear(u_sum)
            for i in T.serial(n_blk):
                cur = i % num_stages
                T.clear(acc)
                for c in T.unroll(NC):
                    T.ptx_wait_group(RING - 1)  # chunk c of block i (and q) has landed ...
                    T.sync_threads()  # ... for every thread; block i - 1's mask is read
                    if c == 0:
                        for j in T.Parallel(BI):
                            slot = i * BI + j
                            key = slot_value(indices, t, slot, -1)
                            ok_s[j] = T.if_then_else((key >= 0) and (key < Tkv), T.float32(1),
                                                     T.float32(0))
                    T.gemm(kv_s[cur * NC + c, :, :], q_s[c, :, :], acc, transpose_B=True,
                           policy=T.GemmWarpPolicy.FullRow)
                    T.sync_threads()  # every warp's GEMM is done with this chunk's buffer
                    if i + num_stages < n_blk:
                        gather_chunk(kv, indices, t, i + num_stages, c, kv_s, cur * NC + c)
                    T.ptx_commit_group()  # empty past the last block: the count stays uniform
                for j, h in T.Parallel(BI, HP):
                    acc[j, h] = T.if_then_else(ok_s[j] > T.float32(0),
                                               T.exp2(acc[j, h] * c2 + nl_s[h]), T.float32(0))
                T.reduce_sum(acc, p_blk, dim=1)
                for j in T.Parallel(BI):
                    p_blk[j] = p_blk[j] / Hf
                    u_sum[j] = u_sum[j] + p_blk[j]
                for j in T.Parallel(BI):
                    if i * BI + j < K:
                        target[t, i * BI + j] = p_blk[j]
            # the groups of blocks past the last, and q's when the row gathered no block, land
            # before the reduction (its scratch may overlap their buffers), and every u of the
            # row is stored and visible to the CTA
            T.ptx_wait_group(0)
            T.sync_threads()
            T.reduce_sum(u_sum, row_u, dim=0)

            # tail: p = u / max(Σ u, 1e-10) over every slot (0 past the last block) and the
            # row's KL over the valid slots
            done = n_blk * BI
            total = T.max(row_u[0], T.float32(EPS))
            kl = T.float32(0)
            for r0 in T.serial(T.ceildiv(K, threads * _UNROLL)):
                for u in T.unroll(_UNROLL):
                    j = (r0 * _UNROLL + u) * threads + tx
                    key_r[u] = slot_value(indices, t, j, -1)
                    score_r[u] = slot_value(scores, t, j, T.float32(0))
                    u_r[u] = T.if_then_else(j < done, target[t, T.min(j, K - 1)],
                                            T.float32(0))
                for u in T.unroll(_UNROLL):
                    j = (r0 * _UNROLL + u) * threads + tx
                    p = u_r[u] / total
                    if j < K:
                        target[t, j] = p
                    if (key_r[u] >= 0) and (key_r[u] < Tkv):
                        log_q = (score_r[u] - m_row) - log_z
                        kl = kl + p * (T.log(T.max(p, T.float32(EPS))) - log_q)
            warp_partials(kl, red_s, 2, lane, warp)
            if tx == 0:
                kl = T.float32(0)
                for w in T.unroll(NW):
                    kl = kl + red_s[2, w]
                rows[t, 0] = kl
                rows[t, 1] = T.Cast(f32, any_ok)

    return dsa_indexer_loss


def variants():
    """Every config the op builds (:func:`config_for`): each D_qk of :data:`HEADS` x its heads
    per CTA x dtype, default schedule (8 kernels)."""
    for D_qk, head_options in HEADS.items():
        for heads in head_options:
            for dt in DTYPES:
                yield dict(D_qk=D_qk, dtype=dt, heads=heads)


def config_for(D_qk: int, H: int, dtype) -> dict | None:
    """The variant a call runs (a ``variants()`` entry), or None where none is built: D_qk in
    :data:`HEADS`, 1 to :data:`MAX_HEADS` heads, a dtype of :data:`DTYPES`."""
    name = str(dtype).removeprefix("torch.")
    if D_qk not in HEADS or name not in DTYPES or not 1 <= H <= MAX_HEADS:
        return None
    heads = next(h for h in HEADS[D_qk] if H <= h)
    return dict(D_qk=D_qk, dtype=name, heads=heads)


def ref_program(scores, q, kv, indices, lse, scale: float, coeff: float, reduction: str):
    """The contract: the op's PyTorch kernel (fp32 math), ``(loss, target)``."""
    from torch_dplr.dsa.ops.loss import indexer_loss_fwd_reference

    return indexer_loss_fwd_reference(scores, q, kv, indices, lse, scale, coeff, reduction)

