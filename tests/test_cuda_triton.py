"""The Triton kernels on the GPU (marker ``cuda``): the per-token ops' CUDA kernels against the
fp64 recurrence at real sizes (decode, short prefills, training on short sequences, reverse
walks, varlen), gates far below a declared bound, the state pool in place, opcheck, and
CUDA-graph capture and replay of a decode step.  Skipped without a GPU."""
import pytest
import torch

import torch_dplr
from torch_dplr.testing import TOLERANCES, make_inputs, recurrence_oracle, rms_ratio

pytestmark = pytest.mark.cuda


def _case(B, T, H, K, cu=None, dtype=torch.bfloat16, seed=0, gate_scale=1.0):
    x = make_inputs(B, T, H, K, dtype=dtype, device="cuda", seed=seed,
                    num_states=B if cu is None else len(cu) - 1)
    x["gk"] = x["gk"] * gate_scale
    return x


def _check(x, cu, reverse, scale=0.5):
    names = "q k v a b gk initial_state".split()
    leaves = [x[n].detach().clone().requires_grad_() for n in names]
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    o, ht = torch_dplr.fused_recurrent_dplr_delta_rule(
        *leaves[:6], scale=scale, initial_state=leaves[6], output_final_state=True,
        reverse=reverse, cu_seqlens=cu_t)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, device="cuda", generator=gen)
    grads = torch.autograd.grad((o, ht), leaves, (do, dht))
    ref = [x[n].detach().double().requires_grad_() for n in names]
    if reverse:  # the oracle walks forward: flip each sequence in time
        bounds = [(0, x["q"].shape[1])] if cu is None else list(zip(cu[:-1], cu[1:]))
        index = torch.cat([torch.arange(e - 1, s - 1, -1) for s, e in bounds]).cuda()
        flip = lambda t: t[:, index]  # noqa: E731
    else:
        flip = lambda t: t  # noqa: E731
    ro, rht = recurrence_oracle(*(flip(t) for t in ref[:6]), scale, ref[6], cu_t)
    ref_grads = torch.autograd.grad((flip(ro), rht), ref, (do.double(), dht.double()))
    bar_out, bar_grad = TOLERANCES[x["q"].dtype]
    for name, got, want in zip(("o", "ht"), (o, ht), (flip(ro), rht)):
        assert torch.isfinite(got).all() and rms_ratio(got, want) < bar_out, name
    for name, got, want in zip("dq dk dv da db dgk dh0".split(), grads, ref_grads):
        assert torch.isfinite(got).all() and rms_ratio(got, want) < bar_grad, name


@pytest.mark.parametrize("B,T,H,K,cu,reverse", [
    (64, 1, 16, 64, None, False),                     # decode steps
    (8, 16, 16, 64, None, False),                     # short prefills / speculative blocks
    (2, 1024, 16, 64, None, False),                   # training on short sequences: the sweep
    (2, 1024, 16, 64, None, True),
    (1, 2048, 16, 64, [0, 1, 700, 701, 2048], False),
    (1, 600, 8, 32, [0, 5, 300, 301, 600], True),
    (4, 8, 8, 128, None, False),                      # K 128: per-token forward, PyTorch backward
])
def test_recurrent_kernels_match_oracle(B, T, H, K, cu, reverse):
    _check(_case(B, T, H, K, cu), cu, reverse)


def test_recurrent_fp32_data_on_the_gpu():
    _check(_case(2, 40, 4, 32, dtype=torch.float32), None, False)


def test_gates_far_below_rwkv7_bound_stay_exact():
    """The per-token path declares no bound, and the sweep's centred pass hands tiles with
    gates x100 and at -1e4 to its exact pass."""
    x = _case(2, 512, 8, 64, gate_scale=100.0)
    x["gk"][:, ::97, :, ::11] = -1e4
    _check(x, None, False)


@pytest.mark.parametrize("B,T", [(16, 1), (2, 300)])  # per-token kernel; the chunked sweep
def test_fused_mul_forms_the_pair_inside(B, T):
    """RWKV-7's kk and a in, the pair (-kk, kk·a) formed by the op: o, the final state and every
    gradient against the fp64 recurrence on that pair."""
    x = _case(B, T, 8, 64, seed=9)
    kk = torch.nn.functional.normalize(x["a"].float(), dim=-1).to(x["a"].dtype)
    rate = torch.sigmoid(x["b"].float()).to(x["b"].dtype)
    names = "q gk k v".split()
    leaves = [t.detach().clone().requires_grad_() for t in
              (*(x[n] for n in names), kk, rate, x["initial_state"])]
    o, ht = torch_dplr.fused_mul_recurrent_rwkv7(*leaves[:6], scale=0.5, initial_state=leaves[6],
                                                 output_final_state=True)
    gen = torch.Generator(device="cuda").manual_seed(2)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    grads = torch.autograd.grad((o, ht), leaves, (do, torch.ones_like(ht)))
    ref = [t.detach().double().requires_grad_() for t in leaves]
    q, gk, k, v, kk64, rate64, h0 = ref
    ro, rht = recurrence_oracle(q, k, v, -kk64, kk64 * rate64, gk, 0.5, h0, None)
    ref_grads = torch.autograd.grad((ro, rht), ref, (do.double(), torch.ones_like(rht)))
    bar_out, bar_grad = TOLERANCES[x["q"].dtype]
    assert rms_ratio(o, ro) < bar_out and rms_ratio(ht, rht) < bar_out
    for name, got, want in zip("dr dw dk dv dkk da dh0".split(), grads, ref_grads):
        assert torch.isfinite(got).all() and rms_ratio(got, want) < bar_grad, name


def test_decode_pool_in_place_matches_functional_decode():
    x = _case(16, 1, 32, 64, seed=3)
    pool = torch.randn(40, 32, 64, 64, device="cuda")
    slots = torch.randperm(40, device="cuda")[:16].to(torch.int32)
    before = pool.clone()
    args = [x[n] for n in "q k v a b gk".split()]
    o = torch_dplr.dplr_decode(*args, pool, slots, scale=1.0)
    o_ref, ht = torch_dplr.fused_recurrent_dplr_delta_rule(
        *(t.double() for t in args), scale=1.0, initial_state=before[slots.long()].double(),
        output_final_state=True)
    assert rms_ratio(o, o_ref) < TOLERANCES[torch.bfloat16][0]
    assert rms_ratio(pool[slots.long()], ht) < 1e-6
    others = torch.ones(40, dtype=torch.bool, device="cuda")
    others[slots.long()] = False
    assert torch.equal(pool[others], before[others])


def test_decode_pool_in_bf16_storage():
    """A bf16 pool on the GPU: the kernel's fp32 step rounded once, against the PyTorch kernel
    on an fp32 copy of the same pool, rounded."""
    x = _case(16, 2, 32, 64, seed=5)
    pool = torch.randn(40, 32, 64, 64, device="cuda").to(torch.bfloat16)
    ref_pool = pool.double()
    slots = torch.randperm(40, device="cuda")[:16].to(torch.int32)
    args = [x[n] for n in "q k v a b gk".split()]
    o = torch_dplr.dplr_decode(*args, pool, slots, scale=1.0)
    o_ref = torch_dplr.dplr_decode(*(t.double() for t in args), ref_pool, slots, scale=1.0)
    assert pool.dtype == torch.bfloat16
    assert rms_ratio(o, o_ref) < TOLERANCES[torch.bfloat16][0]
    assert rms_ratio(pool, ref_pool.to(torch.bfloat16)) < 1e-3


def test_decode_step_replays_in_a_cuda_graph():
    x = _case(8, 1, 16, 64, seed=4)
    args = [x[n] for n in "q k v a b gk".split()]
    pool = torch.randn(8, 16, 64, 64, device="cuda")
    slots = torch.arange(8, dtype=torch.int32, device="cuda")
    start = pool.clone()
    torch_dplr.dplr_decode(*args, pool, slots, scale=1.0, check_values=False)  # warm up
    pool.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = torch_dplr.dplr_decode(*args, pool, slots, scale=1.0, check_values=False)
    pool.copy_(start)
    graph.replay()
    expect = start.clone()
    o_ref = torch_dplr.dplr_decode(*args, expect, slots, scale=1.0, check_values=False)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(pool, expect, rtol=0, atol=0)


def test_opcheck_recurrent_ops_on_kernel_shapes():
    x = _case(2, 40, 2, 32, seed=5)
    cu = torch.empty(0, dtype=torch.int64, device="cuda")
    args = [x[n] for n in "q k v a b gk initial_state".split()]
    for grad in (False, True):
        inputs = [t.detach().clone().requires_grad_(grad) for t in args]
        for pair in (False, True):
            torch.library.opcheck(torch.ops.dplr.recurrent_fwd.default,
                                  (*inputs, cu, 0.5, True, False, pair))
    do = torch.randn_like(x["v"])
    dht = torch.randn(2, 2, 32, 32, device="cuda")
    torch.library.opcheck(torch.ops.dplr.recurrent_bwd.default,
                          (*args, cu, do, dht, 0.5, True, True, True))


# the split's bar against the one-sweep kernel: the same terms with 16-row walk steps; with
# 64-row steps (csrc_triton.chunk_terms) the chunk-64 terms, rounded elsewhere (under the
# interpreter both stand at the same distance from the fp64 recurrence)
SPLIT_BAR = {16: 1e-5, 64: 4e-3}


@pytest.mark.parametrize("walk_rows", [16, 64])
@pytest.mark.parametrize("cu,gate_scale", [(None, 1.0), ([0, 5, 1500, 1501, 4096], 100.0)])
def test_split_forward_matches_the_sweep(cu, gate_scale, walk_rows):
    """The split forward (every tile's or chunk's terms in parallel, then the state walk)
    against the one-sweep forward on the GPU: o, final state and kept states, and the same
    flags, a broken bound included."""
    from csrc_triton import chunk_fwd, state_sweep
    from torch_dplr.ops.varlen import as_one_sequence_list as flat
    from torch_dplr.ops.varlen import kernel_tables
    B = 2 if cu is None else 1
    x = _case(B, 4096 // B, 16, 64, cu, gate_scale=gate_scale, seed=7)
    x["gk"][:, ::301, :, ::13] = -1e4
    tokens = [flat(x[n]) for n in "q k v a b gk".split()]
    cu_t = torch.empty(0, dtype=torch.int64, device="cuda") if cu is None else torch.tensor(
        cu, device="cuda")
    tb = kernel_tables(cu_t, B, 4096 // B, 64, "cuda")
    N = tb.cu_seqlens.numel() - 1
    results = []
    for run in ("sweep", "split"):
        o, ht = torch.empty_like(tokens[2]), torch.empty(N, 16, 64, 64, device="cuda")
        h = torch.zeros(1, tb.chunk_start.numel(), 16, 64, 64, device="cuda")
        flags = torch.full((N, 16), -1, dtype=torch.int32, device="cuda")
        args = (x["initial_state"],)
        if run == "sweep":
            chunk_fwd.launch(*tokens, *args, tb.cu_seqlens, tb.chunk_offsets, o, ht, h, flags,
                             0.125, 64, True, True, True)
        else:
            state_sweep.split_forward(*tokens, *args, tb, o, ht, h, flags, 0.125, 64, True,
                                      True, True, walk_rows=walk_rows)
        results.append((o, ht, h, flags))
    (o, ht, h, flags), (o2, ht2, h2, flags2) = results
    assert torch.equal(flags, flags2) and (flags > 0).any()
    for name, got, want in (("o", o2, o), ("ht", ht2, ht), ("states", h2, h)):
        assert torch.isfinite(got).all() and rms_ratio(got, want) < SPLIT_BAR[walk_rows], name


@pytest.mark.parametrize("walk_rows", [16, 64])
def test_split_backward_matches_the_sweep(walk_rows):
    """The split backward (tile terms, the state-gradient walk, every chunk's gradients in
    parallel) against the one-sweep backward on the GPU, from the same kept states, a broken
    bound included."""
    from csrc_triton import chunk_bwd, chunk_fwd, chunk_grads
    from torch_dplr.ops.varlen import as_one_sequence_list as flat
    from torch_dplr.ops.varlen import kernel_tables
    cu = [0, 5, 1500, 1501, 4096]
    x = _case(1, 4096, 16, 64, cu, seed=8)
    x["gk"][:, ::301, :, ::13] = -1e4
    tokens = [flat(x[n]) for n in "q k v a b gk".split()]
    tb = kernel_tables(torch.tensor(cu, device="cuda"), 1, 4096, 64, "cuda")
    N = len(cu) - 1
    o, ht = torch.empty_like(tokens[2]), torch.empty(N, 16, 64, 64, device="cuda")
    h = torch.empty(1, tb.chunk_start.numel(), 16, 64, 64, device="cuda")
    flags = torch.empty(N, 16, dtype=torch.int32, device="cuda")
    chunk_fwd.launch(*tokens, x["initial_state"], tb.cu_seqlens, tb.chunk_offsets, o, ht, h,
                     flags, 0.125, 64, True, True, True)
    gen = torch.Generator(device="cuda").manual_seed(2)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, device="cuda", generator=gen)
    results = []
    for run in ("sweep", "split"):
        grads = [torch.empty_like(t) for t in tokens] + [torch.empty_like(ht)]
        if run == "sweep":
            ws = torch.empty(chunk_bwd.workspace_shape(16, N, 4, 64, 64), device="cuda")
            chunk_bwd.launch(*tokens, h, do, dht, tb.cu_seqlens, tb.chunk_offsets, flags, ws,
                             *grads, 0.125, 64, True, True, True)
        else:
            chunk_grads.split_backward(*tokens, h, do, dht, tb, *grads, 0.125, 64, True, True,
                                       True, walk_rows=walk_rows)
        results.append(grads)
    for name, got, want in zip("dq dk dv da db dgk dh0".split(), *reversed(results)):
        assert torch.isfinite(got).all() and rms_ratio(got, want) < SPLIT_BAR[walk_rows], name
