"""Sparse MLA forward, warp-specialized: the contract of :mod:`csrc_tl.dsa_sparse_mla_fwd`
(same signature, same results up to summation order) for 64 heads per CTA, with the gather,
the logits and the two halves of the output on three warpgroups that overlap.

Why: the two-warpgroup kernel splits every product over both warpgroups, so each block runs
its gather wait, the logits, the softmax (row statistics meeting in shared memory) and P · V
in one lockstep; at D_qk 576 it holds 32 slots a block, a thin K for P · V.  Here one
warpgroup owns whole rows, so the softmax needs no shared-memory reductions, and 64 slots a
block fit because P is the only per-block scratch.  On an H100 at T 8192, H 128, k 2048, bf16
(``python -m benchmarks.dsa --quick``): 13.1 ms, 356 TFLOPS, against the two-warpgroup
kernel's 21.4 ms, 219 TFLOPS (``TORCH_DPLR_DSA_MLA_FWD_WS=0``).

Warpgroups (384 threads, one CTA per (token, block of 64 heads), as the other kernel)::

    producer   (threads 256-383)  gathers block i's kv rows into stage i % 2 by cp.async,
               16 bytes a thread and instruction, invalid slots zero-filled; the copies
               complete on the stage's ``ready`` mbarrier
    softmax    (threads 0-127)    S = q kvᵀ (all 64 slots, wgmma), the slot mask from the
               indices, online softmax in log2 units, P and alpha to shared memory,
               O[:, :d_v/2] = O·alpha + P kv[:, :d_v/2]
    value      (threads 128-255)  O[:, d_v/2:] = O·alpha + P kv[:, d_v/2:] once P is out

Barriers (mbarriers; parity = the phase's count mod 2): ``ready[s]`` (the producer's
copies), ``free[s]`` (both consumers done with stage s: the producer may refill it),
``p_ready`` (P and alpha written: the value warpgroup may read them), ``p_free`` (the value
warpgroup is done with P: the softmax warpgroup may overwrite it), ``done`` (l written, for
the value warpgroup's normalization).  The block loop runs in pairs so that the stage is a
constant; an odd block count runs one more block past ``k``, whose slots are all invalid
(zero rows, -inf logits: it changes nothing).

Registers (``setmaxnreg``): softmax 240 (its half of O, 128 a thread, and S, 32), value 168,
producer 56.  Shared memory (:func:`smem_bytes`): q, two stages of 64 kv rows, P, alpha and
l: 229,888 B at D_qk 576 (sm_90 allows 232,448 a CTA).

Invalid slots and masks as the other kernel: a slot is valid when its index lies in
``[0, T_kv)`` and it is below ``k``; such rows gather zeros and get a -inf logit; a row with
no valid slot gives ``o = 0`` and ``lse = -inf``; heads past ``H`` load zeros and are not
stored.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# must see the factory's locals at definition time.
import itertools
import math

import tilelang.language as T

from .compile import canonical_dtype, kernel_options
from .dsa_sparse_mla_fwd import DIMS, DTYPES, ref_program
from .tile_macros import LOG2E

__all__ = ["dsa_sparse_mla_fwd_ws_kernel", "variants", "smem_bytes", "supports", "ref_program",
           "HEADS_PER_CTA", "SLOTS_PER_BLOCK"]

HEADS_PER_CTA = 64
SLOTS_PER_BLOCK = 64
THREADS = 384
_ACC = "float32"
_LN2 = math.log(2.0)
_VEC = 8  # elements per 16-byte cp.async (2-byte dtypes)
_ROW_CHUNK = 64  # columns one producer row-group copies per step: 8 threads x 8 elements
_SMEM_LIMIT = 232_448  # dynamic shared memory per CTA on sm_90
_REGS = {"softmax": 240, "value": 168, "producer": 56}  # 128 threads each: 59,392 in all

# TileLang's own warp specialization and TMA lowering off: the roles and their barriers are
# written out here, and the loads are predicated cp.async
_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True}


def smem_bytes(D_qk: int, d_v: int) -> int:
    """q, two stages of kv rows, P (2-byte data), alpha and l (fp32), without TileLang's
    alignment."""
    HB, BI = HEADS_PER_CTA, SLOTS_PER_BLOCK
    return 2 * (HB * D_qk + 2 * BI * D_qk + HB * BI) + 2 * 4 * HB


def supports(D_qk: int, d_v: int) -> bool:
    """Dims this schedule builds: value and rope columns in whole 64-column row groups, halves
    of d_v in whole 32-column steps, shared memory within the limit less 2 KB."""
    return (d_v % _ROW_CHUNK == 0 and (D_qk - d_v) % _ROW_CHUNK == 0 and D_qk >= d_v
            and (d_v // 2) % 32 == 0 and smem_bytes(D_qk, d_v) + 2048 <= _SMEM_LIMIT)


@kernel_options(pass_configs=_PASS_CONFIGS)
def dsa_sparse_mla_fwd_ws_kernel(D_qk: int, d_v: int, dtype: str):
    """prim_func ``dsa_sparse_mla_fwd(q, kv, indices, scale, o, lse)`` (the signature of
    :mod:`csrc_tl.dsa_sparse_mla_fwd`) for 64 heads per CTA."""
    dtype = canonical_dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} not in {DTYPES}")
    if not supports(D_qk, d_v):
        raise ValueError(f"D_qk={D_qk}, d_v={d_v}: not built by the warp-specialized schedule")
    HB, BI = HEADS_PER_CTA, SLOTS_PER_BLOCK
    D_tail = D_qk - d_v
    half = d_v // 2
    value_groups = d_v // _ROW_CHUNK
    f32 = _ACC
    rows_per_step = 128 // (_ROW_CHUNK // _VEC)  # producer rows gathered per step: 16

    Tn, Tkv, H, K = T.dynamic("T, T_kv, H, K")

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
        with T.Kernel(Tn * n_hb, threads=THREADS) as bx:
            t = T.alloc_var("int32", init=bx // n_hb)
            h0 = T.alloc_var("int32", init=(bx % n_hb) * HB)
            tx = T.get_thread_binding()

            q_s = T.alloc_shared((HB, d_v), dtype)
            kv_s = T.alloc_shared((2, BI, d_v), dtype)
            q_tail_s = tail_s = None
            if D_tail:
                q_tail_s = T.alloc_shared((HB, D_tail), dtype)
                tail_s = T.alloc_shared((2, BI, D_tail), dtype)
            p_s = T.alloc_shared((HB, BI), dtype)
            alpha_s = T.alloc_shared((HB,), f32)
            l_s = T.alloc_shared((HB,), f32)

            acc_s = T.alloc_fragment((HB, BI), f32)
            acc_lo = T.alloc_fragment((HB, half), f32)
            acc_hi = T.alloc_fragment((HB, half), f32)
            m = T.alloc_fragment((HB,), f32)
            m_prev = T.alloc_fragment((HB,), f32)
            m_blk = T.alloc_fragment((HB,), f32)
            l = T.alloc_fragment((HB,), f32)
            l_blk = T.alloc_fragment((HB,), f32)
            alpha = T.alloc_fragment((HB,), f32)

            ready = T.alloc_barrier(arrive_count=[128, 128])
            free = T.alloc_barrier(arrive_count=[256, 256])
            p_ready = T.alloc_barrier(arrive_count=256)
            p_free = T.alloc_barrier(arrive_count=256)
            done = T.alloc_barrier(arrive_count=128)

            c = scale * LOG2E  # logits in log2 units
            n_pairs = T.ceildiv(T.ceildiv(K, BI), 2)

            # q's head block by every thread before the roles split (rows past H zero-filled)
            for step in T.unroll(T.ceildiv(HB * D_qk // _VEC, THREADS)):
                flat = step * THREADS + tx
                row = flat // (D_qk // _VEC)
                col = (flat % (D_qk // _VEC)) * _VEC
                if flat < HB * D_qk // _VEC:
                    ok = h0 + row < H
                    head = T.if_then_else(ok, h0 + row, 0)
                    if col < d_v:
                        T.ptx_cp_async(T.access_ptr(q_s[row, col], "w", _VEC),
                                       T.access_ptr(q[t, head, col], "r", _VEC), _VEC,
                                       predicate=ok)
                    elif D_tail:
                        T.ptx_cp_async(T.access_ptr(q_tail_s[row, col - d_v], "w", _VEC),
                                       T.access_ptr(q[t, head, col], "r", _VEC), _VEC,
                                       predicate=ok)
            T.ptx_commit_group()
            T.ptx_wait_group(0)
            T.sync_threads()

            if tx < 128:
                T.set_max_nreg(_REGS["softmax"], 1)
                T.fill(acc_lo, 0)
                T.fill(l, 0)
                T.fill(m, T.min_value(f32))  # finite: an all-invalid block keeps alpha 1
                for i_i in T.serial(n_pairs):
                    for stage in T.unroll(2):
                        blk = i_i * 2 + stage
                        T.barrier_wait(ready[stage], i_i % 2)
                        T.gemm(q_s, kv_s[stage, :, :], acc_s, transpose_B=True,
                               clear_accum=True)
                        if D_tail:
                            T.gemm(q_tail_s, tail_s[stage, :, :], acc_s, transpose_B=True)
                        for h, j in T.Parallel(HB, BI):
                            slot = blk * BI + j
                            k_j = T.if_then_else(slot < K, indices[t, T.min(slot, K - 1)], -1)
                            acc_s[h, j] = T.if_then_else((k_j >= 0) and (k_j < Tkv),
                                                         acc_s[h, j] * c, -T.infinity(f32))
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
                        # the value warpgroup is done with the previous block's P and alpha
                        if blk > 0:
                            T.barrier_arrive(p_free)
                            T.barrier_wait(p_free, (blk - 1) % 2)
                        T.copy(alpha, alpha_s)
                        T.copy(acc_s, p_s)
                        # P and alpha out to the value warpgroup's tensor-core reads before
                        # this warpgroup's own half of P · V, so that both halves overlap
                        T.fence_proxy_async()
                        T.barrier_arrive(p_ready)
                        for h, d in T.Parallel(HB, half):
                            acc_lo[h, d] = acc_lo[h, d] * alpha[h]
                        T.gemm(p_s, kv_s[stage, :, 0:half], acc_lo)
                        T.barrier_arrive(free[stage])
                T.copy(l, l_s)
                T.barrier_arrive(done)
                for h, d in T.Parallel(HB, half):
                    if h0 + h < H:
                        o[t, h0 + h, d] = T.Cast(dtype, T.if_then_else(
                            l[h] > 0, acc_lo[h, d] / l[h], T.float32(0)))
                for h in T.Parallel(HB):
                    if h0 + h < H:
                        lse[t, h0 + h] = T.if_then_else(
                            l[h] > 0, (m[h] + T.log2(l[h])) * _LN2, -T.infinity(f32))
            elif tx < 256:
                T.set_max_nreg(_REGS["value"], 1)
                T.fill(acc_hi, 0)
                for i_i in T.serial(n_pairs):
                    for stage in T.unroll(2):
                        blk = i_i * 2 + stage
                        T.barrier_arrive(p_ready)
                        T.barrier_wait(p_ready, blk % 2)
                        for h, d in T.Parallel(HB, half):
                            acc_hi[h, d] = acc_hi[h, d] * alpha_s[h]
                        T.gemm(p_s, kv_s[stage, :, half:d_v], acc_hi)
                        T.barrier_arrive(free[stage])
                        if blk + 1 < n_pairs * 2:
                            T.barrier_arrive(p_free)
                T.barrier_wait(done, 0)
                for h, d in T.Parallel(HB, half):
                    if h0 + h < H:
                        o[t, h0 + h, half + d] = T.Cast(dtype, T.if_then_else(
                            l_s[h] > 0, acc_hi[h, d] / l_s[h], T.float32(0)))
            else:
                T.set_max_nreg(_REGS["producer"], 0)
                p = tx - 256
                lane_col = (p % (_ROW_CHUNK // _VEC)) * _VEC
                for i_i in T.serial(n_pairs):
                    for stage in T.unroll(2):
                        blk = i_i * 2 + stage
                        T.barrier_wait(free[stage], (i_i % 2) ^ 1)
                        for r in T.unroll(BI // rows_per_step):
                            row = r * rows_per_step + p // (_ROW_CHUNK // _VEC)
                            slot = blk * BI + row
                            key = T.if_then_else(slot < K, indices[t, T.min(slot, K - 1)], -1)
                            ok = (key >= 0) and (key < Tkv)
                            src = T.if_then_else(ok, key, 0)
                            for u in T.unroll(value_groups):
                                col = u * _ROW_CHUNK + lane_col
                                T.ptx_cp_async(T.access_ptr(kv_s[stage, row, col], "w", _VEC),
                                               T.access_ptr(kv[src, col], "r", _VEC), _VEC,
                                               predicate=ok)
                            if D_tail:
                                for u in T.unroll(D_tail // _ROW_CHUNK):
                                    col = u * _ROW_CHUNK + lane_col
                                    T.ptx_cp_async(
                                        T.access_ptr(tail_s[stage, row, col], "w", _VEC),
                                        T.access_ptr(kv[src, d_v + col], "r", _VEC), _VEC,
                                        predicate=ok)
                        T.cp_async_barrier_noinc(ready[stage])

    return dsa_sparse_mla_fwd


def variants():
    """Every config built: each (D_qk, d_v) of the other kernel's dims this schedule supports,
    x dtype."""
    for (D_qk, d_v), dt in itertools.product(DIMS, DTYPES):
        if supports(D_qk, d_v):
            yield dict(D_qk=D_qk, d_v=d_v, dtype=dt)
