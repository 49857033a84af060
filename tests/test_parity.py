"""The composed chunked op against the fp64 per-token recurrence: o, final state, every gradient."""
import pytest
import torch

import torch_dplr
from torch_dplr.testing import TOLERANCES, rms_ratio

from torch_dplr.testing import parity_errors


def assert_within(errors, dtype):
    out_tol, grad_tol = TOLERANCES[dtype]
    bad = {n: e for n, e in errors.items()
           if e > (out_tol if n in ("o", "final_state") else grad_tol)}
    assert not bad, f"error ratios over the {dtype} bar: {bad} (all: {errors})"


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("gates", ["rwkv7", "saturated", "unbounded"])
def test_rect_fp64_exact(chunk_size, gates):
    # T not a multiple of any chunk size: the last chunk is partial.
    errors = parity_errors(2, 83, 2, 16, 12, dtype=torch.float64, gates=gates,
                           chunk_size=chunk_size)
    assert_within(errors, torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_rect_low_precision(dtype, chunk_size):
    errors = parity_errors(1, 150, 2, 64, dtype=dtype, chunk_size=chunk_size,
                           lower_bound=-0.6065)
    assert_within(errors, dtype)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("gates", ["rwkv7", "unbounded"])
def test_varlen(chunk_size, gates):
    # 1-token sequences, an empty one, one shorter than a chunk and a long one.
    cu = [0, 1, 2, 2, 19, 150, 151]
    errors = parity_errors(1, 151, 2, 16, dtype=torch.float64, gates=gates,
                           chunk_size=chunk_size, cu_seqlens=cu)
    assert_within(errors, torch.float64)


def test_varlen_bf16_no_state():
    errors = parity_errors(1, 200, 2, 32, dtype=torch.bfloat16, chunk_size=32,
                           cu_seqlens=[0, 64, 65, 200], use_state=False)
    assert_within(errors, torch.bfloat16)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_single_token(chunk_size):
    errors = parity_errors(3, 1, 2, 8, dtype=torch.float64, chunk_size=chunk_size)
    assert_within(errors, torch.float64)


def test_large_head_dims():
    errors = parity_errors(1, 40, 1, 256, 128, dtype=torch.float32, chunk_size=32)
    assert_within(errors, torch.float32)


def test_rwkv7_entry_point_scale_one():
    def rwkv7(q, k, v, a, b, gk, **kw):
        return torch_dplr.chunk_rwkv7(q, gk, k, v, a, b, **kw)
    errors = parity_errors(1, 70, 2, 16, dtype=torch.float64, fn=rwkv7, scale=1.0)
    assert_within(errors, torch.float64)


@pytest.mark.parametrize("cu", [None, [0, 5, 5, 40]])
@pytest.mark.parametrize("reverse", [False, True])
def test_fused_recurrent(cu, reverse):
    def recurrent(q, k, v, a, b, gk, chunk_size=None, lower_bound=None, **kw):
        return torch_dplr.fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, **kw)
    if not reverse:
        errors = parity_errors(1, 40, 2, 8, dtype=torch.float64, fn=recurrent, cu_seqlens=cu)
        assert_within(errors, torch.float64)
        return
    # reverse=True equals the forward walk over time-flipped sequences.
    from torch_dplr.testing import make_inputs
    inp = make_inputs(1, 40, 2, 8, dtype=torch.float64, num_states=1 if cu is None else 3)
    cu_t = None if cu is None else torch.tensor(cu)
    o, ht = torch_dplr.fused_recurrent_dplr_delta_rule(
        *(inp[n] for n in "q k v a b gk".split()), initial_state=inp["initial_state"],
        output_final_state=True, reverse=True, cu_seqlens=cu_t)
    spans = [(0, 40)] if cu is None else list(zip(cu[:-1], cu[1:]))
    for n, (s, e) in enumerate(spans):
        flip = lambda x: x[:, s:e].flip(1)  # noqa: E731
        o_f, ht_f = torch_dplr.fused_recurrent_dplr_delta_rule(
            *(flip(inp[m]) for m in "q k v a b gk".split()),
            initial_state=inp["initial_state"][n:n + 1], output_final_state=True)
        torch.testing.assert_close(o[:, s:e], o_f.flip(1))
        torch.testing.assert_close(ht[n:n + 1], ht_f)


def test_no_grad_forward_matches_training_forward():
    from torch_dplr.testing import make_inputs
    inp = make_inputs(2, 50, 2, 16)
    args = [inp[n] for n in "q k v a b gk".split()]
    with torch.no_grad():
        o1, h1 = torch_dplr.chunk_dplr_delta_rule(*args, output_final_state=True)
    o2, h2 = torch_dplr.chunk_dplr_delta_rule(*(x.requires_grad_() for x in args),
                                              output_final_state=True)
    torch.testing.assert_close(o1, o2.detach(), rtol=0, atol=0)
    torch.testing.assert_close(h1, h2.detach(), rtol=0, atol=0)


def test_final_state_only_and_output_only_losses():
    """Gradients flow when only one of (o, final state) reaches the loss."""
    from torch_dplr.testing import make_inputs
    inp = make_inputs(1, 40, 2, 8, dtype=torch.float64)
    xs = [inp[n].requires_grad_() for n in "q k v a b gk initial_state".split()]
    o, ht = torch_dplr.chunk_dplr_delta_rule(*xs[:6], initial_state=xs[6],
                                             output_final_state=True, chunk_size=16)
    g_state = torch.autograd.grad(ht.sum(), xs, retain_graph=True)
    g_out = torch.autograd.grad(o.sum(), xs)
    from torch_dplr.testing import recurrence_oracle
    o_r, ht_r = recurrence_oracle(*xs[:6], 8 ** -0.5, xs[6])
    ref_state = torch.autograd.grad(ht_r.sum(), xs, retain_graph=True, allow_unused=True)
    for got, ref in zip(g_state, ref_state):
        torch.testing.assert_close(got, torch.zeros_like(got) if ref is None else ref)
    for got, ref in zip(g_out, torch.autograd.grad(o_r.sum(), xs)):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("cu", [None, [0, 1, 1, 70, 150]], ids=["rect", "varlen"])
@pytest.mark.parametrize("use_state", [True, False], ids=["h0", "no_h0"])
def test_fused_forward_op_matches_oracle(dtype, cu, use_state):
    """dplr::chunk_fwd_fused (the no-grad forward) against the fp64 recurrence: o and the
    final state, rect with a partial last chunk and varlen with 1-token and empty sequences."""
    from torch_dplr.testing import make_inputs, recurrence_oracle
    B, T = (2, 83) if cu is None else (1, 150)
    inp = make_inputs(B, T, 2, 16, dtype=dtype, num_states=B if cu is None else len(cu) - 1)
    q, k, v, a, b, gk, h0 = (inp[n] for n in "q k v a b gk initial_state".split())
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    h0_arg = h0 if use_state else h0.new_empty(0)
    o, ht = torch.ops.dplr.chunk_fwd_fused(q, k, v, a, b, gk, h0_arg, cu_t, 0.25, 64, -0.6065,
                                           use_state)
    assert o.dtype == v.dtype and ht.dtype == (torch.float64 if dtype == torch.float64
                                               else torch.float32)
    o_ref, ht_ref = recurrence_oracle(q, k, v, a, b, gk, 0.25, h0 if use_state else None,
                                      None if cu is None else cu_t)
    assert_within({"o": rms_ratio(o, o_ref), "final_state": rms_ratio(ht, ht_ref)}, dtype)
