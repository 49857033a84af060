"""Lightning indexer fused with top-k selection (``dsa::indexer_topk``): per query the ``topk``
visible keys of highest index score, without the ``[T, T]`` scores ever leaving the SM.

Contract (``torch_dplr.dsa.reference.topk``, see :func:`ref_program`)::

    score[t, s] = Σ_h w[t, h] · ReLU(q_idx[t, h] · k_idx[s])      lo[t] <= s <= t (visible)
    indices[t]  = the first topk keys of a stable descending sort of row t's visible scores
                  (ties to the smaller position), written ascending, then -1

A selected key whose score is -inf counts as empty (-1), as in the reference; a NaN score ranks
above +inf (torch.sort's order); -0.0 ties with +0.0.  ``lo[t]`` (``starts``) is the first key
of t's sequence (``torch_dplr.dsa.reference.layout.key_starts``; ``t + 1`` for padding tokens,
which select nothing).  Scores are fp32: bf16 / fp16 products accumulated in fp32 by the tensor
cores, ReLU as ``torch.relu`` (a NaN product stays NaN), times fp32 ``w``, summed over the heads
in fp32: the reference's sum in another order, so the two select the same keys wherever their
scores are equal, and may differ only by keys within fp32 rounding of a row's k-th score.

Selection: exact radix select, recomputing the scores
------------------------------------------------------
A score is mapped to an order-preserving 32-bit key (sign flip; -0.0 -> +0.0; NaN -> the
largest).  The k-th largest key of a row is found most significant digit first, each digit by
one pass over the row's keys that histograms the digit of the keys still matching the prefix
fixed so far: digits of 12, 12 and 8 bits (4096-bin histograms in shared memory; sign, exponent
and 3 mantissa bits first).  After a pass, the bin holding the remaining rank fixes the next
digit; a row is settled early when it needs every key of that bin, and at once when it sees at
most topk keys (then every visible key is taken).  A last pass writes the selection: a key is
taken when its prefix is above the row's, or equal to it and among the first ``need`` such keys
in position order (the ties), and it is written at the count of taken keys before it, so a row
comes out ascending by construction; slots past the count get -1.  No candidate buffer, no
sort, no atomics on the output: the result is deterministic and equals the reference whenever
the scores do.  The passes must see the same scores bit for bit (a histogram count that the
writing pass did not reproduce would leave slots unfilled): one loop body, the same
instructions on the same data, serves every pass; the writing pass also never writes past
``topk``.

Every pass recomputes the block scores (the GEMM is the cost): a CTA runs 1 + (0 to 3) passes,
the histogram passes only while one of its rows is unsettled.  With continuous random scores a
row is nearly always settled after two digits (24 bits), so a CTA of long rows makes about 3
passes (3.01 in the CPU model of ``tests/test_tl_dsa_indexer_topk.py``), one of rows shorter
than topk 1.

Grid and tiles
--------------
One CTA per block of ``BQ = 256 / H_idx`` consecutive queries (heaviest first: the last query
block gets CTA 0), ``threads`` = 256.  It keeps the block's q rows ``[BQ · H_idx, D_idx]`` in
shared memory for all passes and walks the keys its rows see (from the smallest ``lo`` to its
last query) in blocks of ``BN`` = 64 keys:

    S       K_blk [BN, D] · Q [BQ·H, D]ᵀ on the tensor cores (fp32 accumulator), wgmma: one
            warpgroup's M = 64 keys, the two warpgroups split the BQ·H = 256 columns
    scores  ReLU(S) · w, summed over each query's H heads -> [BN, BQ] fp32, into shared memory
    select  a warp per (query, 32 keys): histogram pass: the digit of every visible key that
            matches the row's prefix, added with one shared-memory atomic per distinct bin of
            the warp (__match_any_sync); last pass: a warp per query, its 32-key chunks in
            order, ballots of "tied" and "taken" give each key its tie rank and output slot

The next block's keys are fetched by cp.async into the other buffer during this one (hand
rolled double buffer, as ``dsa_sparse_mla_fwd``; rows past T are zero-filled and never
visible).  Within a block the GEMM, the head sum and the select step follow one another, with
barriers between them (no warp specialization: one CTA per SM).  After a histogram pass each
row's threshold bin is found by 256 / BQ threads, each summing 4096·BQ / 256 bins (a rotated
start, so the threads hit distinct banks), a prefix over those partial sums, and one serial
walk by the thread whose bins hold the rank.

Bytes and complexity (T tokens, one causal sequence, H_idx = 64, D_idx = 128, topk = 2048)
---------------------------------------------------------------------------------------
HBM: q_idx, w and starts read once, k_idx ``T · D · 2`` bytes (2 MiB at T = 8192, L2-resident)
read by every CTA over its key range once per pass, ``indices`` written once (``T · topk · 4``
bytes, 64 MiB at T = 8192): no [T, T] tensor, no workspace.  Compute: passes ×
``T² / 2 · H · D`` multiply-adds (2.7e11 per pass at T = 8192) plus ``O(T² / 2)`` select work
per pass.  Shared memory per CTA (:func:`smem_bytes`): q 64 KiB, two key buffers 32 KiB, the
BQ histograms 64 KiB, scores and row state ~2 KiB: about 162 KiB, one CTA per SM.

Signature (caller-allocated output; T and K = topk symbolic)::

    dsa_indexer_topk(q_idx, k_idx, w, starts, indices)

q_idx [T, H_idx, D_idx] dtype; k_idx [T, D_idx] dtype; w [T, H_idx] fp32; starts [T] int32;
indices [T, K] int32.  q_idx, k_idx and w contiguous and 16-byte aligned (cp.async, vector
loads).  The op
``dsa::indexer_topk`` launches it on CUDA where :func:`config_for` names a variant
(``torch_dplr/dsa/ops/topk.py``).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals at definition time.
import itertools

import tilelang.language as T

from .compile import canonical_dtype, kernel_options

__all__ = ["dsa_indexer_topk_kernel", "config_for", "smem_bytes", "variants", "ref_program",
           "score_keys", "DIMS", "DTYPES", "DIGITS", "NBINS", "COLUMNS", "NEG_INF_KEY"]

#: (H_idx, D_idx) pairs built: DeepSeek-V3.2's indexer (64 heads of 128) and a smaller one.
DIMS = ((64, 128), (32, 64))
DTYPES = ("bfloat16", "float16")
#: GEMM columns per CTA, BQ · H_idx: queries per CTA = COLUMNS // H_idx.
COLUMNS = 256
#: (shift, bits) of the key digit each histogram pass resolves, most significant first.
DIGITS = ((20, 12), (8, 12), (0, 8))
NBINS = 1 << max(bits for _, bits in DIGITS)
#: The key of a -inf score, the smallest a score can have: a key never taken (the reference
#: turns a selected -inf into -1).
NEG_INF_KEY = 0x007FFFFF

_ACC = "float32"
_SMEM_LIMIT = 232_448  # dynamic shared memory per CTA on sm_90 (227 KiB)
_SMEM_MARGIN = 4096  # TileLang's alignment and headroom (see dsa_sparse_mla_fwd)

# Warp specialization off (no producer / consumer split: the loads are explicit cp.async
# groups); TMA off: with symbolic shapes its descriptors would be encoded at every launch.
# Barriers by hand: the automatic pass takes the warp collectives (__match_any_sync) and the
# histogram atomics for shared-memory hazards and puts block-wide barriers between them;
# every barrier the kernel needs is written out and says what it orders.
_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True,
                 "tl.disable_thread_storage_sync": True}


def smem_bytes(H: int, D: int, dtype_bytes: int = 2, block_N: int = 64,
               threads: int = 256) -> int:
    """Shared memory of the kernel (before TileLang's alignment): q, two key buffers, the block
    scores, the histograms, the threshold search's partial sums and the per-row state."""
    BQ = COLUMNS // H
    tiles = dtype_bytes * (BQ * H * D + 2 * block_N * D)
    return tiles + 4 * (BQ * block_N + BQ * NBINS + threads + 9 * BQ + 2)


def _check_config(H, D, dtype, block_N, threads):
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if H not in (32, 64):  # 256 GEMM columns of 8 or 4 queries (16 heads: 16 histograms)
        raise ValueError(f"H_idx={H}: 32 or 64")
    if D % 64 or not 64 <= D <= 256:
        raise ValueError(f"D_idx={D}: a multiple of 64 in [64, 256]")
    if block_N != 64:  # one warpgroup's wgmma M; two 32-key chunks per query
        raise ValueError(f"block_N={block_N}: 64 keys per block")
    if threads != 256:
        raise ValueError(f"threads={threads}: two warpgroups (256)")
    size = smem_bytes(H, D, 2, block_N, threads)
    if size + _SMEM_MARGIN > _SMEM_LIMIT:
        raise ValueError(f"H_idx={H}, D_idx={D}: {size} bytes of shared memory, more than "
                         f"{_SMEM_LIMIT} - {_SMEM_MARGIN}")


def _u32(value: int):
    return T.uint32(value)


def score_key(x):
    """The order-preserving uint32 key of an fp32 score (integer ops only, so no float
    simplification can touch the special cases): -0.0 as +0.0, NaN above everything."""
    bits = T.reinterpret(x, "uint32")
    bits = T.if_then_else(bits == _u32(0x80000000), _u32(0), bits)
    key = T.if_then_else((bits >> _u32(31)) != _u32(0), ~bits, bits | _u32(0x80000000))
    nan = (bits & _u32(0x7FFFFFFF)) > _u32(0x7F800000)
    return T.if_then_else(nan, _u32(0xFFFFFFFF), key)


@kernel_options(pass_configs=_PASS_CONFIGS)
def dsa_indexer_topk_kernel(H: int, D: int, dtype: str, block_N: int = 64, threads: int = 256):
    """prim_func ``dsa_indexer_topk(q_idx, k_idx, w, starts, indices)`` for one config
    (signature in the module docstring).  H / D: index heads and head dim; dtype: bf16 / fp16
    q_idx and k_idx."""
    dtype = canonical_dtype(dtype)
    _check_config(H, D, dtype, block_N, threads)
    f32 = _ACC
    BN = block_N
    BQ = COLUMNS // H
    NW = threads // 32  # warps
    NC = BN // 32  # 32-key chunks per block and query
    ITEMS = BQ * NC  # (query, chunk) items of a histogram pass, a multiple of the warps
    QPW = (BQ + NW - 1) // NW  # queries per warp in the writing pass
    TPQ = threads // BQ  # threshold search: threads per query
    BPT = NBINS // TPQ  # ... and bins per thread
    n_passes = len(DIGITS) + 1
    full = _u32(0xFFFFFFFF)

    Tn, K = T.dynamic("T, K")

    @T.macro
    def load_keys(k_idx, s0, buf, k_s):
        """k_idx rows s0 .. s0 + BN into buffer ``buf`` (one cp.async group; rows past T
        zero-filled)."""
        T.async_copy(k_idx[s0 : s0 + BN, 0:D], k_s[buf, :, :])

    def digit(p):
        """(shift, mask) of histogram pass p (a loop variable) as expressions."""
        shift, mask = _u32(DIGITS[-1][0]), _u32((1 << DIGITS[-1][1]) - 1)
        for d in reversed(range(len(DIGITS) - 1)):
            shift = T.if_then_else(p == d, _u32(DIGITS[d][0]), shift)
            mask = T.if_then_else(p == d, _u32((1 << DIGITS[d][1]) - 1), mask)
        return shift, mask

    @T.prim_func
    def dsa_indexer_topk(
        q_idx: T.Tensor((Tn, H, D), dtype),
        k_idx: T.Tensor((Tn, D), dtype),
        w: T.Tensor((Tn, H), f32),
        starts: T.Tensor((Tn,), "int32"),
        indices: T.Tensor((Tn, K), "int32"),
    ):
        n_qb = T.ceildiv(Tn, BQ)
        with T.Kernel(n_qb, threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = T.alloc_var("int32", init=tx % 32)
            warp = T.alloc_var("int32", init=tx // 32)
            below = T.alloc_var("uint32", init=(_u32(1) << T.Cast("uint32", tx % 32)) - _u32(1))
            t0 = T.alloc_var("int32", init=(n_qb - 1 - bx) * BQ)  # heaviest query block first

            q_s = T.alloc_shared((BQ * H, D), dtype)
            k_s = T.alloc_shared((2, BN, D), dtype)
            sc_s = T.alloc_shared((BQ, BN), f32)
            hist_s = T.alloc_shared((BQ, NBINS), "int32")
            part_s = T.alloc_shared((BQ, TPQ), "int32")
            # per row: first visible key, prefix and its mask, keys still needed at the prefix,
            # unsettled flag; the threshold search's bin, keys above it, keys in it
            lo_s = T.alloc_shared((BQ,), "int32")
            pfx_s = T.alloc_shared((BQ,), "uint32")
            msk_s = T.alloc_shared((BQ,), "uint32")
            need_s = T.alloc_shared((BQ,), "int32")
            act_s = T.alloc_shared((BQ,), "int32")
            res_s = T.alloc_shared((BQ, 3), "int32")
            rng_s = T.alloc_shared((2,), "int32")  # first key of the CTA's range, its blocks

            acc = T.alloc_fragment((BN, BQ * H), f32)
            acc_r = T.reshape(acc, (BN, BQ, H))
            scores = T.alloc_fragment((BN, BQ), f32)
            w_f = T.alloc_fragment((BQ, H), f32)

            kmin = T.alloc_var("int32")
            kmax = T.alloc_var("int32")
            n_blk = T.alloc_var("int32")
            busy = T.alloc_var("int32")
            run = T.alloc_var("int32")
            part = T.alloc_var("int32")
            above = T.alloc_var("int32")
            found = T.alloc_var("int32")
            shift = T.alloc_var("uint32")  # this pass's digit
            dmask = T.alloc_var("uint32")
            key = T.alloc_var("uint32")  # a score's order-preserving key
            # warp collectives go to variables: every lane of the warp executes them
            peers = T.alloc_var("uint32")
            eq_m = T.alloc_var("uint32")
            take_m = T.alloc_var("uint32")
            base = T.alloc_local((QPW,), "int32")  # the writing pass: keys taken so far
            tied = T.alloc_local((QPW,), "int32")  # ... and keys at the prefix so far

            # this block's q rows (a row past T repeats the last one: it is never used)
            for i in T.unroll(BQ):
                T.async_copy(q_idx[T.min(t0 + i, Tn - 1), 0:H, 0:D], q_s[i * H : (i + 1) * H, :])
            for i, h in T.Parallel(BQ, H):
                w_f[i, h] = T.if_then_else(t0 + i < Tn, w[T.min(t0 + i, Tn - 1), h], T.float32(0))
            if tx < BQ:
                t = t0 + tx
                lo = T.if_then_else(t < Tn, T.max(starts[T.min(t, Tn - 1)], 0), t + 1)
                n = T.max(t - lo + 1, 0)  # visible keys (0 past T: lo = t + 1)
                lo_s[tx] = lo
                pfx_s[tx] = _u32(0)
                msk_s[tx] = _u32(0)  # every key matches the empty prefix: a short row takes all
                need_s[tx] = T.min(n, K)
                act_s[tx] = T.if_then_else(n > K, 1, 0)
            T.sync_threads()
            if tx == 0:
                kmin = Tn
                kmax = -1
                for i in T.unroll(BQ):
                    if lo_s[i] <= t0 + i:
                        kmin = T.min(kmin, lo_s[i])
                        kmax = T.max(kmax, t0 + i)
                rng_s[0] = kmin
                rng_s[1] = T.if_then_else(kmax >= kmin, T.ceildiv(kmax - kmin + 1, BN), 0)
            for r in T.unroll(QPW):
                base[r] = 0
                tied[r] = 0
            T.ptx_wait_group(0)
            T.sync_threads()
            kmin = rng_s[0]
            n_blk = rng_s[1]

            for p in T.serial(n_passes):
                writing = p == n_passes - 1
                shift = digit(p)[0]
                dmask = digit(p)[1]
                # the previous pass's row state is written, its histogram reads are done (and
                # in pass 0 every thread has read rng_s, which may share memory with hist_s)
                T.sync_threads()
                busy = 0
                for i in T.unroll(BQ):
                    busy = busy | act_s[i]
                if writing or busy != 0:  # uniform over the CTA
                    if not writing:
                        for i, b in T.Parallel(BQ, NBINS):
                            hist_s[i, b] = 0
                    if n_blk > 0:
                        load_keys(k_idx, kmin, 0, k_s)
                    for blk in T.serial(n_blk):
                        cur = blk % 2
                        s0 = kmin + blk * BN
                        # every thread is done with block blk - 1 (its buffer, sc_s), and the
                        # histogram clear is visible
                        T.sync_threads()
                        if blk + 1 < n_blk:
                            load_keys(k_idx, s0 + BN, 1 - cur, k_s)
                            T.ptx_wait_group(1)
                        else:
                            T.ptx_wait_group(0)
                        T.sync_threads()  # block blk's keys landed, from every thread

                        T.gemm(k_s[cur, :, :], q_s, acc, transpose_B=True, clear_accum=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        # ReLU as torch.relu: a NaN product stays NaN (fmaxf would give 0)
                        for n, i, h in T.Parallel(BN, BQ, H):
                            x = acc_r[n, i, h]
                            acc_r[n, i, h] = T.if_then_else(x < T.float32(0), T.float32(0),
                                                            x) * w_f[i, h]
                        T.reduce_sum(acc_r, scores, dim=2, clear=True)
                        for n, i in T.Parallel(BN, BQ):
                            sc_s[i, n] = scores[n, i]
                        T.sync_threads()

                        if not writing:
                            # histogram of the digit of the visible keys at the row's prefix
                            for it in T.unroll(ITEMS // NW):
                                i = (warp + it * NW) % BQ
                                c = (warp + it * NW) // BQ
                                s = s0 + c * 32 + lane
                                key = score_key(sc_s[i, c * 32 + lane])
                                hit = ((s >= lo_s[i]) and (s <= t0 + i) and (act_s[i] != 0)
                                       and ((key & msk_s[i]) == pfx_s[i]))
                                b = (key >> shift) & dmask
                                peers = T.call_extern("uint32", "__match_any_sync", full,
                                                      T.if_then_else(hit, b, full))
                                # the lowest lane of each bin adds the bin's count
                                if hit and (peers & below) == _u32(0):
                                    T.atomic_add(hist_s[i, T.Cast("int32", b)],
                                                 T.Cast("int32", T.popcount(peers)))
                        else:
                            # the writing pass: a warp per query, its chunks in key order
                            for r in T.unroll(QPW):
                                i = warp + r * NW
                                if i < BQ:  # uniform over the warp
                                    for c in T.unroll(NC):
                                        s = s0 + c * 32 + lane
                                        key = score_key(sc_s[i, c * 32 + lane])
                                        vis = (s >= lo_s[i]) and (s <= t0 + i)
                                        eq = vis and ((key & msk_s[i]) == pfx_s[i])
                                        eq_m = T.Cast("uint32", T.ballot_sync(eq))
                                        rank = tied[r] + T.Cast("int32", T.popcount(eq_m & below))
                                        take = (vis and (((key & msk_s[i]) > pfx_s[i])
                                                         or (eq and (rank < need_s[i])))
                                                and (key != _u32(NEG_INF_KEY)))
                                        take_m = T.Cast("uint32", T.ballot_sync(take))
                                        slot = base[r] + T.Cast("int32",
                                                                T.popcount(take_m & below))
                                        if take and slot < K:
                                            indices[t0 + i, slot] = s
                                        base[r] = base[r] + T.Cast("int32", T.popcount(take_m))
                                        tied[r] = tied[r] + T.Cast("int32", T.popcount(eq_m))

                    if not writing:
                        # each unsettled row's threshold bin: the bin holding its need-th key
                        # from the top; TPQ threads per row, BPT bins each, highest bins first
                        T.sync_threads()  # every block's histogram atomics are done
                        qi = tx // TPQ
                        j = tx % TPQ
                        hi_bin = NBINS - (j + 1) * BPT
                        part = 0
                        for r in T.serial(BPT):  # rotated start: threads hit distinct banks
                            part = part + hist_s[qi, hi_bin + (r + j) % BPT]
                        part_s[qi, j] = part
                        T.sync_threads()
                        above = 0
                        for r in T.serial(TPQ):
                            above = above + T.if_then_else(r < j, part_s[qi, r], 0)
                        need = need_s[qi]
                        if (act_s[qi] != 0) and (above < need) and (need <= above + part):
                            run = above
                            found = 0
                            for r in T.serial(BPT):
                                b = NBINS - 1 - j * BPT - r
                                h = hist_s[qi, b]
                                if found == 0 and run + h >= need:
                                    res_s[qi, 0] = b
                                    res_s[qi, 1] = run
                                    res_s[qi, 2] = h
                                    found = 1
                                run = run + h
                        T.sync_threads()
                        if tx < BQ:
                            if act_s[tx] != 0:
                                left = need_s[tx] - res_s[tx, 1]
                                pfx_s[tx] = pfx_s[tx] | (T.Cast("uint32", res_s[tx, 0]) << shift)
                                msk_s[tx] = msk_s[tx] | (dmask << shift)
                                need_s[tx] = left
                                # settled when it takes its whole bin, or the key is complete
                                act_s[tx] = T.if_then_else(
                                    (p < len(DIGITS) - 1) and (res_s[tx, 2] > left), 1, 0)

            # the slots past each row's count
            for r in T.unroll(QPW):
                i = warp + r * NW
                if i < BQ:
                    if t0 + i < Tn:
                        for m in T.serial(T.ceildiv(K, 32)):
                            slot = m * 32 + lane
                            if slot >= base[r] and slot < K:
                                indices[t0 + i, slot] = -1

    return dsa_indexer_topk


def variants():
    """Every config the op builds (:func:`config_for`): each (H_idx, D_idx) of :data:`DIMS` x
    dtype, default schedule."""
    for (H, D), dt in itertools.product(DIMS, DTYPES):
        yield dict(H=H, D=D, dtype=dt)


def config_for(H: int, D: int, dtype) -> dict | None:
    """The variant a call runs (a ``variants()`` entry), or None where none is built."""
    name = str(dtype).removeprefix("torch.")
    if (H, D) not in DIMS or name not in DTYPES:
        return None
    return dict(H=H, D=D, dtype=name)


def score_keys(scores):
    """:func:`score_key` on a torch fp32 tensor (int64 keys), for the CPU model and tests."""
    import torch

    bits = scores.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.where(bits == 0x80000000, 0, bits)
    key = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return torch.where((bits & 0x7FFFFFFF) > 0x7F800000, 0xFFFFFFFF, key)


def ref_program(q_idx, k_idx, w, cu_seqlens, topk: int):
    """The contract: the op's PyTorch kernel (fp32 scores), ``indices``."""
    from torch_dplr.dsa.ops.topk import indexer_topk_reference

    return indexer_topk_reference(q_idx, k_idx, w, cu_seqlens, topk)
