"""torch_dplr.affine: composition, the log-depth scan, its reverse-scan backward, segmented
joins, and the identity context parallelism rests on (a piece's map from the public op)."""
import pytest
import torch

import torch_dplr
from torch_dplr import affine
from torch_dplr.testing import make_inputs, rms_ratio

H, K, V = 2, 5, 3


def random_maps(S, seed=0, batch=(H,)):
    gen = torch.Generator().manual_seed(seed)
    M = torch.randn(S, *batch, K, K, generator=gen, dtype=torch.float64) * (0.6 / K ** 0.5)
    c = torch.randn(S, *batch, K, V, generator=gen, dtype=torch.float64)
    h0 = torch.randn(*batch, K, V, generator=gen, dtype=torch.float64)
    return M, c, h0


def loop_states(M, c, h0):
    states = [h0]
    for s in range(M.shape[0]):
        states.append(M[s] @ states[-1] + c[s])
    return torch.stack(states)


def test_compose_is_apply_then_apply():
    M, c, h = random_maps(2)
    both = affine.compose((M[0], c[0]), (M[1], c[1]))
    expected = affine.apply(M[1], c[1], affine.apply(M[0], c[0], h))
    torch.testing.assert_close(affine.apply(*both, h), expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("S", [1, 2, 3, 5, 8, 13])
def test_prefix_compose_matches_sequential(S):
    M, c, _ = random_maps(S, seed=S)
    PM, Pc = affine.prefix_compose(M, c)
    run_M, run_c = M[0], c[0]
    for s in range(S):
        if s:
            run_M, run_c = affine.compose((run_M, run_c), (M[s], c[s]))
        torch.testing.assert_close(PM[s], run_M, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(Pc[s], run_c, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("S", [0, 1, 6, 9])
@pytest.mark.parametrize("with_h0", [True, False])
def test_chain_states_forward(S, with_h0):
    M, c, h0 = random_maps(S, seed=10 + S)
    x = affine.chain_states_forward(M, c, h0 if with_h0 else None)
    ref = loop_states(M, c, h0 if with_h0 else torch.zeros_like(h0))
    assert x.shape == (S + 1, H, K, V)
    torch.testing.assert_close(x, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("S", [1, 4, 7])
def test_chain_states_backward_is_the_reverse_scan(S):
    M, c, h0 = random_maps(S, seed=20 + S)
    gen = torch.Generator().manual_seed(3)
    dx = torch.randn(S + 1, H, K, V, dtype=torch.float64, generator=gen)
    ours = [t.clone().requires_grad_() for t in (M, c, h0)]
    ref = [t.clone().requires_grad_() for t in (M, c, h0)]
    got = torch.autograd.grad((affine.chain_states(*ours) * dx).sum(), ours)
    want = torch.autograd.grad((loop_states(*ref) * dx).sum(), ref)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-12)


def test_chain_states_gradcheck():
    M, c, h0 = (t.requires_grad_() for t in random_maps(3, seed=5, batch=()))
    assert torch.autograd.gradcheck(affine.chain_states, (M, c, h0))


@pytest.mark.parametrize("first", [[True, False, False, True, False, True],
                                   [False, False, True, True, False, False]])
def test_segment_states(first):
    S = len(first)
    M, c, _ = random_maps(S, seed=7)
    h0 = torch.randn(S, H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    first_t = torch.tensor(first)
    ours = [t.clone().requires_grad_() for t in (M, c, h0)]
    x, y = affine.segment_states(ours[0], ours[1], first_t, ours[2])

    ref = [t.clone().requires_grad_() for t in (M, c, h0)]
    xs, ys, state = [], [], torch.zeros(H, K, V, dtype=torch.float64)
    for s in range(S):
        state = ref[2][s] if first[s] else state
        xs.append(state)
        state = ref[0][s] @ state + ref[1][s]
        ys.append(state)
    x_ref, y_ref = torch.stack(xs), torch.stack(ys)
    torch.testing.assert_close(x, x_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)

    gen = torch.Generator().manual_seed(9)
    dx, dy = (torch.randn(S, H, K, V, dtype=torch.float64, generator=gen) for _ in range(2))
    got = torch.autograd.grad((x * dx).sum() + (y * dy).sum(), ours)
    want = torch.autograd.grad((x_ref * dx).sum() + (y_ref * dy).sum(), ref)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_segments_joined_by_maps_equal_one_call(chunk_size):
    """Time parallelism with the public op: cut one sequence into segments (lengths not
    multiples of the chunk size, one shorter than a chunk), get each segment's zero-start
    outputs and end state ``c``, and its map ``M`` with the per-token term
    ``scale·M_tᵀ q_t`` from a call with v = 0 (width K) and initial state I; join with the
    scan.  Outputs, final state and every gradient equal one call on the whole sequence."""
    T, Hh, Kk, Vv = 100, 2, 8, 6
    cuts = [0, 37, 45, 100]
    inp = make_inputs(1, T, Hh, Kk, Vv, dtype=torch.float64, seed=4)
    names = ("q", "k", "v", "a", "b", "gk", "initial_state")
    ours = {n: inp[n].clone().requires_grad_() for n in names}
    ref = {n: inp[n].clone().requires_grad_() for n in names}
    scale = Kk ** -0.5
    eye = torch.eye(Kk, dtype=torch.float64).expand(1, Hh, Kk, Kk)

    zero_start, per_token, Ms, cs = [], [], [], []
    for s, e in zip(cuts[:-1], cuts[1:]):
        q, k, v, a, b, gk = (ours[n][:, s:e] for n in names[:6])
        o0, c = torch_dplr.chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=scale,
                                                 output_final_state=True, chunk_size=chunk_size)
        oM, M = torch_dplr.chunk_dplr_delta_rule(q, k, torch.zeros_like(q), a, b, gk, scale=scale,
                                                 initial_state=eye, output_final_state=True,
                                                 chunk_size=chunk_size)
        zero_start.append(o0), per_token.append(oM), Ms.append(M[0]), cs.append(c[0])
    x = affine.chain_states(torch.stack(Ms), torch.stack(cs), ours["initial_state"][0])
    o = torch.cat([o0 + torch.einsum("bthk,hkv->bthv", oM, x[i])
                   for i, (o0, oM) in enumerate(zip(zero_start, per_token))], dim=1)
    ht = x[-1:]

    o_ref, ht_ref = torch_dplr.chunk_dplr_delta_rule(
        *(ref[n] for n in names[:6]), scale=scale, initial_state=ref["initial_state"],
        output_final_state=True, chunk_size=chunk_size)
    assert rms_ratio(o, o_ref) < 1e-12 and rms_ratio(ht, ht_ref) < 1e-12
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(o.shape, generator=gen, dtype=torch.float64), \
        torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [ours[n] for n in names])
    want = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), [ref[n] for n in names])
    for n, g, w in zip(names, got, want):
        assert rms_ratio(g, w) < 1e-11, n
