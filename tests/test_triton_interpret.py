"""The Triton kernels (``csrc_triton``) run under Triton's interpreter on the CPU and are
checked against the fp64 recurrence and the PyTorch kernels: the chunked sweep's forward and
backward in every scheme (centred, a broken bound redone exactly, no bound), rect and varlen,
forward and reverse walks; the CUDA op bodies of ``dplr::recurrent_fwd`` / ``recurrent_bwd``
/ ``decode_pool`` that launch them.  No GPU needed: the interpreter runs every program of a
launch in turn on the host (the numerics of tensor-core products aside)."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

pytest.importorskip("triton")

from torch_dplr.testing import TOLERANCES, make_inputs, recurrence_oracle, rms_ratio  # noqa: E402


pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter is on only without a GPU (conftest.py); tests/test_cuda_triton.py "
           "runs the kernels on the GPU")


@pytest.fixture(scope="module")
def kernels():
    return (importlib.import_module("csrc_triton.chunk_fwd"),
            importlib.import_module("csrc_triton.chunk_bwd"))


def _inputs(B, T, H, K, cu, gates="rwkv7", gate_scale=1.0, spikes=False, dtype=torch.bfloat16,
            seed=2):
    x = make_inputs(B, T, H, K, dtype=dtype, gates=gates, seed=seed,
                    num_states=B if cu is None else len(cu) - 1)
    x["gk"] = x["gk"] * gate_scale
    if spikes:
        x["gk"][0, 5::29, 0, ::7] = -1e4
    return x


def _sweep(kernels, x, C, cu, bounded, reverse=False, state_split=True):
    """Forward and backward through the sweep kernels; returns outputs, grads, flags, do, dht."""
    from torch_dplr.ops.varlen import as_one_sequence_list as flat
    from torch_dplr.ops.varlen import kernel_tables
    chunk_fwd, chunk_bwd = kernels
    q, k, v, a, b, gk, h0 = (x[n] for n in "q k v a b gk initial_state".split())
    B, T, H, K = q.shape
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    tb = kernel_tables(cu_t, B, T, C, "cpu")
    N = tb.cu_seqlens.numel() - 1
    o, ht = torch.empty_like(v), torch.empty(N, H, K, K)
    h = torch.empty(1, tb.chunk_start.numel(), H, K, K)
    flags = torch.full((N, H), -1, dtype=torch.int32)
    tokens = [flat(t) for t in (q, k, v, a, b, gk)]
    chunk_fwd.launch(*tokens, h0, tb.cu_seqlens, tb.chunk_offsets, flat(o), ht, h, flags,
                     K ** -0.5, C, True, True, bounded, reverse, state_split=state_split)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(v.shape, generator=gen).to(v.dtype)
    dht = torch.randn(ht.shape, generator=gen)
    grads = [torch.empty_like(t) for t in (q, k, v, a, b, gk)]
    dh0 = torch.empty(N, H, K, K)
    ws = torch.empty(chunk_bwd.workspace_shape(H, N, C // 16, K, K))
    chunk_bwd.launch(*tokens, h, flat(do), dht, tb.cu_seqlens, tb.chunk_offsets, flags, ws,
                     *map(flat, grads), dh0, K ** -0.5, C, True, True, bounded, reverse,
                     state_split=state_split)
    return [o, ht], grads + [dh0], flags, do, dht


def _oracle(x, cu, do, dht):
    leaves = [x[n].detach().double().requires_grad_() for n in "q k v a b gk initial_state".split()]
    cu_t = None if cu is None else torch.tensor(cu)
    o, ht = recurrence_oracle(*leaves[:6], x["q"].shape[-1] ** -0.5, leaves[6], cu_t)
    return [o, ht], list(torch.autograd.grad((o, ht), leaves, (do.double(), dht.double())))


def _assert_within(outs, grads, ref_outs, ref_grads, dtype):
    bar_out, bar_grad = TOLERANCES[dtype]
    for name, got, want in zip(("o", "final state"), outs, ref_outs):
        assert torch.isfinite(got).all() and rms_ratio(got, want) < bar_out, name
    for name, got, want in zip("dq dk dv da db dgk dh0".split(), grads, ref_grads):
        assert torch.isfinite(got).all() and rms_ratio(got, want) < bar_grad, name


CASES = {  # name: (B, T, H, K, cu_seqlens, chunk, input options, bounded)
    "rwkv7-c16": (2, 70, 2, 32, None, 16, {}, True),
    "rwkv7-c32": (2, 70, 2, 32, None, 32, {}, True),
    "rwkv7-c64-varlen": (1, 150, 2, 32, [0, 1, 40, 40, 150], 64, {}, True),
    "unbounded-no-bound": (1, 100, 2, 32, None, 32, dict(gates="unbounded"), False),
}


@pytest.mark.parametrize("case", CASES)
def test_sweep_matches_oracle(kernels, case):
    B, T, H, K, cu, C, options, bounded = CASES[case]
    x = _inputs(B, T, H, K, cu, **options)
    outs, grads, flags, do, dht = _sweep(kernels, x, C, cu, bounded)
    _assert_within(outs, grads, *_oracle(x, cu, do, dht), torch.bfloat16)


def test_state_rounded_once_in_products(kernels):
    """``state_split=False`` (the state and v_new rounded once to bf16 where they enter a
    product, the state still accumulated in fp32) over 400 tokens: o, the final state and every
    gradient within the suite's bars, and further from the fp64 recurrence than the hi/lo
    products (what the option trades)."""
    cu = [0, 400, 700]
    x = _inputs(1, 700, 2, 32, cu, seed=9)
    once = _sweep(kernels, x, 64, cu, bounded=True, state_split=False)
    split = _sweep(kernels, x, 64, cu, bounded=True)
    ref_outs, ref_grads = _oracle(x, cu, once[3], once[4])
    _assert_within(once[0], once[1], ref_outs, ref_grads, torch.bfloat16)
    assert rms_ratio(once[0][1], ref_outs[1]) > rms_ratio(split[0][1], ref_outs[1])


@pytest.mark.parametrize("options", [dict(gate_scale=100.0), dict(spikes=True)])
def test_broken_bound_is_redone_exactly(kernels, options):
    """Gates far below RWKV-7's bound (x100, and single gates at -1e4) under a declared bound:
    the centred pass flags the (sequence, head) pairs it cannot take and the exact pass redoes
    them; every output and gradient stays finite and within the bars."""
    cu = [0, 3, 64, 130]
    x = _inputs(1, 130, 2, 32, cu, **options)
    outs, grads, flags, do, dht = _sweep(kernels, x, 32, cu, bounded=True)
    assert (flags > 0).any() and (flags >= 0).all()
    _assert_within(outs, grads, *_oracle(x, cu, do, dht), torch.bfloat16)


def _forward(chunk_fwd, x, C, cu, bounded, reverse=False, split=False, **knobs):
    """The sweep forward alone (training: states kept), or with ``split`` the split forward
    (``csrc_triton.state_sweep``: tile terms, then the state walk); returns o, ht, states,
    flags."""
    from torch_dplr.ops.varlen import as_one_sequence_list as flat
    from torch_dplr.ops.varlen import kernel_tables
    q, k, v, a, b, gk, h0 = (x[n] for n in "q k v a b gk initial_state".split())
    B, T, H, K = q.shape
    tb = kernel_tables(torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu),
                       B, T, C, "cpu")
    N = tb.cu_seqlens.numel() - 1
    o, ht = torch.empty_like(v), torch.empty(N, H, K, K)
    h = torch.zeros(1, tb.chunk_start.numel(), H, K, K)  # a spare last slot stays unwritten
    flags = torch.full((N, H), -1, dtype=torch.int32)
    tokens = [flat(t) for t in (q, k, v, a, b, gk)]
    if split:
        from csrc_triton import state_sweep
        state_sweep.split_forward(*tokens, h0, tb, flat(o), ht, h, flags, K ** -0.5, C, True,
                                  True, bounded, **knobs)
    else:
        chunk_fwd.launch(*tokens, h0, tb.cu_seqlens, tb.chunk_offsets, flat(o), ht, h, flags,
                         K ** -0.5, C, True, True, bounded, reverse, **knobs)
    return o, ht, h, flags


@pytest.mark.parametrize("knobs", [dict(block_v=8), dict(block_v=16)])
@pytest.mark.parametrize("reverse", [False, True])
def test_forward_schedules_agree(kernels, knobs, reverse):
    """Value blocks (each program recomputing the key-side terms) give the one-block
    schedule's o, final state, kept states and flags, a broken bound included."""
    cu = [0, 3, 64, 130]
    x = _inputs(1, 130, 2, 32, cu, spikes=True)
    base = _forward(kernels[0], x, 32, cu, True, reverse)
    other = _forward(kernels[0], x, 32, cu, True, reverse, **knobs)
    assert (base[3] > 0).any() and torch.equal(base[3], other[3])
    for name, got, want in zip(("o", "ht", "states"), other, base):
        assert rms_ratio(got, want) < 1e-5, name
    with pytest.raises(ValueError, match="block_v=12"):
        _forward(kernels[0], x, 32, cu, True, reverse, block_v=12)


@pytest.mark.parametrize("case", [
    (1, 130, [0, 3, 64, 130], 32, dict(spikes=True), True),  # a broken bound, varlen
    (2, 70, None, 64, {}, True),
    (1, 100, None, 16, dict(gates="unbounded"), False),
    (1, 100, None, 32, dict(gate_scale=100.0), True),
])
def test_split_forward_is_the_sweep(kernels, case):
    """Tile terms in parallel, then the state walk: bit for bit the one-sweep forward's o,
    final state, kept states and (with a bound, where the backward reads them) flags: the
    same terms, rounded at the same points."""
    B, T, cu, C, options, bounded = case
    x = _inputs(B, T, 2, 32, cu, **options)
    want = _forward(kernels[0], x, C, cu, bounded)
    got = _forward(kernels[0], x, C, cu, bounded, split=True)
    for name, g, w in list(zip(("o", "ht", "states", "flags"), got, want))[:4 if bounded else 3]:
        assert torch.equal(g, w), name
    if options.get("spikes") or options.get("gate_scale"):
        assert (got[3] > 0).any()
    blocks = _forward(kernels[0], x, C, cu, bounded, split=True, block_v=16)
    assert rms_ratio(blocks[0], want[0]) < 1e-5


@pytest.mark.parametrize("case", [
    (1, 130, [0, 3, 64, 130], 32, dict(spikes=True), True),  # a broken bound, varlen
    (2, 70, None, 64, {}, True),
    (1, 100, None, 16, dict(gates="unbounded"), False),
])
def test_split_backward_is_the_sweep(kernels, case):
    """Tile terms, the state-gradient walk, then every chunk's gradients in parallel: bit for
    bit the one-sweep backward's gradients and dh0 (the same terms, rounded at the same
    points), from the same kept states."""
    from csrc_triton import chunk_grads
    from torch_dplr.ops.varlen import as_one_sequence_list as flat
    from torch_dplr.ops.varlen import kernel_tables
    B, T, cu, C, options, bounded = case
    x = _inputs(B, T, 2, 32, cu, **options)
    (_o, ht), want, _flags, do, dht = _sweep(kernels, x, C, cu, bounded)
    _, _, h, _ = _forward(kernels[0], x, C, cu, bounded)
    tb = kernel_tables(torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu),
                       B, T, C, "cpu")
    tokens = [flat(x[n]) for n in "q k v a b gk".split()]
    grads = [torch.empty_like(t) for t in tokens]
    dh0 = torch.empty_like(ht)
    chunk_grads.split_backward(*tokens, h, flat(do), dht, tb, *grads, dh0, 32 ** -0.5, C, True,
                               True, bounded)
    for name, g, w in zip("dq dk dv da db dgk dh0".split(), [*grads, dh0],
                          [*(flat(t) for t in want[:6]), want[6]]):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("case", [
    (1, 150, [0, 1, 40, 40, 150], {}, True),
    (2, 128, None, dict(gate_scale=100.0), True),  # every block broken: redone exactly
    (1, 130, [0, 3, 64, 130], dict(spikes=True), True),
    (1, 100, None, dict(gates="unbounded"), False),
])
def test_chunk_terms_are_the_staged_terms(case):
    """``csrc_triton.chunk_terms`` (four 16-row blocks, the blocks below the diagonal from
    decays split at block ends) against the staged ops' chunk-64 terms (``chunk_intra_fwd``,
    ``chunk_wy_fwd``, PyTorch kernels): w, u, A_qk, A_qb within a bf16 rounding; the flags
    mark blocks exactly where a broken bound is."""
    from csrc_triton import chunk_terms
    from torch_dplr.ops.varlen import as_one_sequence_list as flat
    from torch_dplr.ops.varlen import kernel_tables
    B, T, cu, options, bounded = case
    x = _inputs(B, T, 2, 32, cu, **options)
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    tb = kernel_tables(cu_t, B, T, 64, "cpu")
    *terms, flags = chunk_terms.compute(*(flat(x[n]) for n in "q k v a b gk".split()), tb,
                                        32 ** -0.5, bounded)
    gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = torch.ops.dplr.chunk_intra_fwd(
        x["q"], x["k"], x["a"], x["b"], x["gk"], cu_t, 32 ** -0.5, 64, float("-inf"))
    _, w, u = torch.ops.dplr.chunk_wy_fwd(A_ab, A_ak, ag, x["v"], cu_t, 64)
    for name, got, want in zip(("w", "u", "A_qk", "A_qb"), terms, (w, u, A_qk, A_qb)):
        got = got.reshape(want.shape)
        assert torch.isfinite(got).all() and rms_ratio(got, want) < 2e-3, name
    broken = bool(options.get("spikes") or options.get("gate_scale"))
    assert bool((flags > 0).any()) == broken and (flags >= 0).all()


@pytest.mark.parametrize("case", [
    (1, 130, [0, 3, 64, 130], dict(spikes=True), True),  # a broken bound, varlen
    (1, 100, None, dict(gates="unbounded"), False),
])
def test_64_row_walk_matches_oracle(kernels, case):
    """The split forward and backward with a 64-row step per chunk (every chunk's terms in
    parallel, ``csrc_triton.chunk_terms``) against the fp64 recurrence: o, final state and
    every gradient within the suite's bars, and (with a bound) the one-sweep forward's flags,
    so either backward can follow it."""
    from csrc_triton import chunk_grads
    from torch_dplr.ops.varlen import as_one_sequence_list as flat
    from torch_dplr.ops.varlen import kernel_tables
    B, T, cu, options, bounded = case
    x = _inputs(B, T, 2, 32, cu, **options)
    o, ht, h, flags = _forward(kernels[0], x, 64, cu, bounded, split=True, walk_rows=64)
    if bounded:
        assert torch.equal(flags, _forward(kernels[0], x, 64, cu, bounded)[3])
        assert (flags > 0).any()
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen)
    tb = kernel_tables(torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu),
                       B, T, 64, "cpu")
    tokens = [flat(x[n]) for n in "q k v a b gk".split()]
    grads = [torch.empty_like(t) for t in tokens]
    dh0 = torch.empty_like(ht)
    chunk_grads.split_backward(*tokens, h, flat(do), dht, tb, *grads, dh0, 32 ** -0.5, 64, True,
                               True, bounded, walk_rows=64)
    ref_outs, ref_grads = _oracle(x, cu, do, dht)
    _assert_within([o, ht], [*(g.view_as(x[n]) for g, n in zip(grads, "q k v a b gk".split())),
                             dh0], ref_outs, ref_grads, torch.bfloat16)
    with pytest.raises(ValueError, match="walk_rows=64"):
        _forward(kernels[0], x, 32, cu, bounded, split=True, walk_rows=64)


def test_sweep_schemes_agree_where_both_apply(kernels):
    """With gates inside the bound the exact scheme finds nothing to redo and gives the
    centred scheme's result (the same products)."""
    x = _inputs(2, 50, 2, 32, None)
    fast = _sweep(kernels, x, 16, None, bounded=True)
    exact = _sweep(kernels, x, 16, None, bounded=False)
    assert (fast[2] == 0).all()
    for got, want in zip(fast[0] + fast[1], exact[0] + exact[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reverse_walk_matches_flipped_sequences(kernels):
    """REVERSE walks each sequence from its end: the same as the forward walk over the
    sequences flipped in time."""
    cu = [0, 9, 40, 77]
    x = _inputs(1, 77, 2, 32, cu)
    rev = _sweep(kernels, x, 16, cu, bounded=True, reverse=True)
    index = torch.cat([torch.arange(e - 1, s - 1, -1) for s, e in zip(cu[:-1], cu[1:])])
    flipped = dict(x, **{n: x[n][:, index] for n in "q k v a b gk".split()})
    # the oracle of the flipped sequences, with the cotangents flipped with the tokens
    ref_outs, ref_grads = _oracle(flipped, cu, rev[3][:, index], rev[4])
    _assert_within([rev[0][0][:, index], rev[0][1]],
                   [g[:, index] for g in rev[1][:6]] + [rev[1][6]], ref_outs, ref_grads,
                   torch.bfloat16)


@pytest.fixture
def op_bodies():
    """The CUDA op bodies of the per-token ops, which launch the kernels (CPU tensors run
    them under the interpreter)."""
    from torch_dplr.ops import decode, recurrent
    return recurrent, decode


@pytest.mark.parametrize("dtype,T,cu,reverse", [
    (torch.bfloat16, 1, None, False),        # decode: the per-token kernel
    (torch.float32, 5, [0, 1, 1, 5], True),  # fp32: per-token forward, PyTorch backward
    (torch.bfloat16, 150, None, True),       # long enough for the sweep
    (torch.bfloat16, 180, [0, 2, 100, 180], False),
])
def test_recurrent_cuda_bodies_match_reference(op_bodies, dtype, T, cu, reverse):
    recurrent, _ = op_bodies
    B = 2 if cu is None else 1
    x = _inputs(B, T, 2, 32, cu, dtype=dtype, seed=4)
    args = [x[n] for n in "q k v a b gk initial_state".split()]
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    o, ht = recurrent.recurrent_fwd_cuda(*args, cu_t, 0.5, True, reverse)
    ref = recurrent.recurrent_fwd_reference(*(t.double() for t in args), cu_t, 0.5, True,
                                            reverse)
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(o.shape, generator=gen).to(dtype), torch.randn(ht.shape, generator=gen)
    grads = recurrent.recurrent_bwd_cuda(*args, cu_t, do, dht, 0.5, True, True, reverse)
    ref_grads = recurrent.recurrent_bwd_reference(*(t.double() for t in args), cu_t,
                                                  do.double(), dht.double(), 0.5, True, True,
                                                  reverse)
    _assert_within([o, ht], grads, ref, ref_grads, dtype)


@pytest.mark.parametrize("cu", [None, [0, 1, 4, 4, 6]])
def test_decode_pool_cuda_body_updates_only_its_slots(op_bodies, cu):
    _, decode = op_bodies
    B, T = (4, 1) if cu is None else (1, 6)
    x = _inputs(B, T, 2, 64, None, seed=6)
    pool = torch.randn(7, 2, 64, 64)
    slots = torch.tensor([5, 0, 3, 6], dtype=torch.int32)
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    args = [x[n] for n in "q k v a b gk".split()]
    got_pool, want_pool = pool.clone(), pool.double()
    o = decode.decode_pool_cuda(*args, got_pool, slots, cu_t, 0.7)
    o_ref = decode.decode_pool_reference(*(t.double() for t in args), want_pool, slots, cu_t, 0.7)
    assert rms_ratio(o, o_ref) < TOLERANCES[torch.bfloat16][0]
    assert rms_ratio(got_pool, want_pool) < 1e-6
    untouched = [1, 2, 4]
    assert torch.equal(got_pool[untouched], pool[untouched])


def test_decode_pool_cuda_body_with_a_bf16_pool(op_bodies):
    """The kernel reads a bf16 pool into its fp32 walk and rounds the new state to nearest
    even once: the PyTorch kernel's result (fp32 step, then ``.to(bfloat16)``) to within one
    bf16 rounding where the two fp32 walks differ in their last bits."""
    _, decode = op_bodies
    x = _inputs(4, 2, 2, 64, None, seed=8)
    pool = torch.randn(7, 2, 64, 64).to(torch.bfloat16)
    slots = torch.tensor([5, 0, 3, 6], dtype=torch.int32)
    cu_t = torch.empty(0, dtype=torch.int64)
    args = [x[n] for n in "q k v a b gk".split()]
    got_pool, want_pool = pool.clone(), pool.clone()
    o = decode.decode_pool_cuda(*args, got_pool, slots, cu_t, 0.7)
    o_ref = decode.decode_pool_reference(*args, want_pool, slots, cu_t, 0.7)
    assert got_pool.dtype == torch.bfloat16
    assert rms_ratio(o, o_ref) < 1e-5
    ulp = want_pool.float().abs() * 2.0 ** -7  # one bf16 unit at the value, an upper bound
    assert ((got_pool.float() - want_pool.float()).abs() <= ulp).all()
    assert rms_ratio(got_pool, want_pool) < 1e-3
    untouched = [1, 2, 4]
    assert torch.equal(got_pool[untouched], pool[untouched])


def test_flagged_per_token_kernel_redoes_only_its_pairs():
    """``FLAGGED``: the (sequence, head) pairs set in ``flags`` get the recurrence, every other
    entry of ``o`` and ``ht`` keeps what was there (the fused forward's exact redo)."""
    from csrc_triton import recurrent as per_token
    from torch_dplr.ops.varlen import as_one_sequence_list as flat
    cu = [0, 3, 3, 10]
    x = _inputs(1, 10, 2, 32, cu, seed=8)
    tokens = [flat(x[n]) for n in "q k v a b gk".split()]
    h0 = x["initial_state"]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    flags = torch.tensor([[1, 0], [0, 1], [0, 1]], dtype=torch.int32)
    o = torch.full_like(tokens[2], 7.0)
    ht = torch.full((3, 2, 32, 32), 7.0)
    per_token.launch(*tokens, h0, cu_t, cu_t, o, ht, 0.5, True, False, False, flags=flags)
    o_ref, ht_ref = recurrence_oracle(*(x[n] for n in "q k v a b gk".split()), 0.5, h0, cu_t)
    o_ref = o_ref.to(o.dtype)
    pairs = {(0, 0), (1, 1), (2, 1)}
    for n, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        for h in range(2):
            got_o, got_ht = o[0, start:end, h], ht[n, h]
            if (n, h) in pairs:
                assert rms_ratio(got_ht, ht_ref[n, h]) < 1e-5
                if end > start:
                    assert rms_ratio(got_o, o_ref[0, start:end, h]) < 1e-2
            else:
                assert (got_o == 7.0).all() and (got_ht == 7.0).all()
