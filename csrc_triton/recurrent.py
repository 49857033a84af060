"""The per-token recurrence for decode and short sequences (``dplr::recurrent_fwd``,
``dplr::decode_pool``)::

    S_t = diag(exp(gk_t)) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ,   o_t = scale · S_tᵀ q_t

One program per (V-block, head, sequence) keeps its ``[K, BV]`` slice of the fp32 state in
registers and walks the sequence token by token (from its end with ``REVERSE``), all in fp32;
``a_tᵀ S`` and ``S_tᵀ q_t`` are reductions over K inside the program.  Reading and writing
the state once is the traffic floor of a decode step: 2 · 4·K·V bytes per (sequence, head).

Sequence n covers tokens ``cu_seqlens[n] .. cu_seqlens[n+1] - 1``, or with ``RECT`` (a rect
batch of ``seq_len`` tokens each) ``n·seq_len .. (n+1)·seq_len - 1``: a rect call needs no
offsets tensor made per call, so a decode step is this one launch.

The start state is row ``state_rows[n]`` of ``h0`` when ``INDEXED`` (a state pool: the final
state goes back into the same row of ``ht``, which may be the same tensor), else row ``n``.
``h0`` and ``ht`` are fp32, or bf16 for a lower-precision pool: read into the fp32 walk, the
final state rounded to nearest even once when stored.
With ``RWKV7_PAIR`` the ``a`` and ``b`` pointers hold RWKV-7's ``kk`` and in-context rate ``a``,
and the program forms the DPLR pair ``a_t = -kk_t``, ``b_t = kk_t · a_t`` in fp32 (FLA's
``fused_mul_recurrent_rwkv7``): no launch and no rounding of the pair outside.
With ``FLAGGED`` a program runs only where ``flags[n, h]`` (int32 ``[N, H]``) is non-zero and
leaves the rest of ``o`` and ``ht`` as they are: the exact recompute of the (sequence, head)
pairs whose gates broke a declared bound in the fused chunked forward (``ops/fused.py``).

Signature (contiguous ``[B, T, H, D]`` token tensors; a varlen call's are ``[1, T, H, D]``)::

    recurrent_fwd(q, k, v, a, b, gk, h0, state_rows, cu_seqlens, flags, o, ht, scale,
                  seq_len, ...)
"""
import triton
import triton.language as tl

from ._common import round_to


def config(K: int, V: int) -> tuple[int, int]:
    """(V-block width, warps): 4096 state entries per program, four warps for K <= 64, one
    beyond.  On the H200 (benchmarks/decode.py, CUDA-graph replay, H32, batches 1-512) these
    were the fastest of BV in {16, 32, 64} x warps in {1, 2, 4} at D 64, and within 1% of the
    fastest at D 128."""
    BV = min(V, max(16, 4096 // K))
    return BV, 4 if K <= 64 else 1


@triton.jit
def recurrent_fwd_kernel(q, k, v, a, b, gk, h0, state_rows, cu_seqlens, flags, o, ht, scale,
                         seq_len, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                         USE_H0: tl.constexpr, INDEXED: tl.constexpr, REVERSE: tl.constexpr,
                         FLAGGED: tl.constexpr, RECT: tl.constexpr, RWKV7_PAIR: tl.constexpr):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.program_id(2)
    if RECT:
        bos = i_n.to(tl.int64) * seq_len
        eos = bos + seq_len
    else:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if FLAGGED:  # an unflagged pair walks no token and stores nothing
        keep = tl.load(flags + i_n * H + i_h) != 0
        eos = tl.where(keep, eos, bos)
    if INDEXED:
        row = tl.load(state_rows + i_n).to(tl.int64)
    else:
        row = i_n.to(tl.int64)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    state = (row * H + i_h) * K * V + ck[:, None] * V + cv[None, :]
    if USE_H0:  # a state pool may store bf16: the walk is fp32 either way
        S = tl.load(h0 + state).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for t in range(eos - bos):
        if REVERSE:
            tok = eos - 1 - t
        else:
            tok = bos + t
        at_k = (tok * H + i_h) * K + ck
        at_v = (tok * H + i_h) * V + cv
        q_t = tl.load(q + at_k).to(tl.float32)
        k_t = tl.load(k + at_k).to(tl.float32)
        a_t = tl.load(a + at_k).to(tl.float32)
        b_t = tl.load(b + at_k).to(tl.float32)
        if RWKV7_PAIR:  # a_t holds kk, b_t RWKV-7's a
            b_t = a_t * b_t
            a_t = -a_t
        g_t = tl.load(gk + at_k).to(tl.float32)
        v_t = tl.load(v + at_v).to(tl.float32)
        a_S = tl.sum(a_t[:, None] * S, axis=0)
        S = S * tl.exp(g_t)[:, None] + b_t[:, None] * a_S[None, :] + k_t[:, None] * v_t[None, :]
        o_t = tl.sum(q_t[:, None] * S, axis=0) * scale
        tl.store(o + at_v, round_to(o_t, o.dtype.element_ty))
    S = round_to(S, ht.dtype.element_ty)  # fp32: as it is
    if FLAGGED:
        tl.store(ht + state, S, mask=(tl.zeros([K, BV], dtype=tl.int32) + keep.to(tl.int32)) != 0)
    else:
        tl.store(ht + state, S)


def launch(q, k, v, a, b, gk, h0, state_rows, cu_seqlens, o, ht, scale: float, use_h0: bool,
           indexed: bool, reverse: bool, BV: int | None = None, num_warps: int | None = None,
           flags=None, rwkv7_pair: bool = False):
    """Run the kernel on ``[B, T, H, D]`` token tensors: a rect batch of B sequences when
    ``cu_seqlens`` is None, else the flattened token list it cuts (``state_rows`` read only
    when ``indexed``; only the pairs set in ``flags`` when given; with ``rwkv7_pair``, ``a``
    and ``b`` are RWKV-7's ``kk`` and ``a``); ``BV`` and ``num_warps`` default to
    :func:`config`."""
    B, T, H, K = q.shape
    V = v.shape[3]
    rect = cu_seqlens is None
    N = B if rect else cu_seqlens.shape[0] - 1
    default_bv, default_warps = config(K, V)
    BV, num_warps = BV or default_bv, num_warps or default_warps
    flagged = flags is not None
    unused = ht  # a pointer argument the specialization never reads
    recurrent_fwd_kernel[(V // BV, H, N)](q, k, v, a, b, gk, h0,
                                          state_rows if indexed else unused,
                                          unused if rect else cu_seqlens,
                                          flags if flagged else unused, o, ht, scale, T, H=H,
                                          K=K, V=V, BV=BV, USE_H0=use_h0, INDEXED=indexed,
                                          REVERSE=reverse, FLAGGED=flagged, RECT=rect,
                                          RWKV7_PAIR=rwkv7_pair, num_warps=num_warps)
