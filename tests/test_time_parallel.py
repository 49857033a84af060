"""Time parallelism inside one call (``torch_dplr.time_parallel``): sequences cut into segments
along T and joined with the affine chunk map give the uncut call's outputs, final state and
every gradient; calls it does not apply to run uncut; a bad setting raises."""
import pytest
import torch

import torch_dplr
from torch_dplr import time_parallel
from torch_dplr.testing import TOLERANCES, make_inputs, recurrence_oracle, rms_ratio

NAMES = ("q", "k", "v", "a", "b", "gk", "initial_state")


def _inputs(B, T, H, K, V, dtype, seed=1):
    x = make_inputs(B, T, H, K, dtype=dtype, gates="rwkv7", seed=seed, num_states=B)
    if V != K:
        gen = torch.Generator().manual_seed(seed + 1)
        x["v"] = torch.randn(B, T, H, V, generator=gen).to(dtype)
        x["initial_state"] = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64).to(
            x["initial_state"].dtype)
    return x


def _call(x, segments, monkeypatch, chunk_size, with_state=True):
    """o, final state and the gradient of every input of one chunked call."""
    monkeypatch.setenv("TORCH_DPLR_TIME_SEGMENTS", str(segments))
    leaves = [x[n].detach().clone().requires_grad_() for n in NAMES]
    o, ht = torch_dplr.chunk_dplr_delta_rule(
        *leaves[:6], initial_state=leaves[6] if with_state else None, output_final_state=True,
        chunk_size=chunk_size)
    gen = torch.Generator().manual_seed(3)
    do, dht = torch.randn(o.shape, generator=gen).to(o.dtype), torch.randn(ht.shape, generator=gen)
    grads = torch.autograd.grad((o, ht), leaves[:6 + with_state], (do, dht))
    return o, ht, grads


@pytest.mark.parametrize("K,V", [(32, 32), (32, 16)], ids=["K=V", "K!=V"])
@pytest.mark.parametrize("segments,chunk_size", [(2, 64), (4, 16)])
@pytest.mark.parametrize("with_state", [True, False], ids=["h0", "no_h0"])
def test_segmented_call_is_the_uncut_call(monkeypatch, K, V, segments, chunk_size, with_state):
    x = _inputs(2, 256, 2, K, V, torch.float64)
    want = _call(x, 1, monkeypatch, chunk_size, with_state)
    got = _call(x, segments, monkeypatch, chunk_size, with_state)
    for name, g, w in zip(("o", "final state"), got[:2], want[:2]):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)
    for name, g, w in zip(NAMES, got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"d{name}")


def test_segmented_bf16_within_the_bars(monkeypatch):
    """bf16 over 8 segments of a 1024-token sequence against the fp64 recurrence: the join adds
    one rounding of o, and the suite's bars hold."""
    x = _inputs(1, 1024, 2, 32, 32, torch.bfloat16, seed=4)
    o, ht, grads = _call(x, 8, monkeypatch, 64)
    ref = [x[n].detach().double().requires_grad_() for n in NAMES]
    ro, rht = recurrence_oracle(*ref[:6], 32 ** -0.5, ref[6])
    gen = torch.Generator().manual_seed(3)
    do, dht = torch.randn(o.shape, generator=gen).to(o.dtype), torch.randn(ht.shape, generator=gen)
    ref_grads = torch.autograd.grad((ro, rht), ref, (do.double(), dht.double()))
    bar_out, bar_grad = TOLERANCES[torch.bfloat16]
    assert rms_ratio(o, ro) < bar_out and rms_ratio(ht, rht) < bar_out
    for name, g, w in zip(NAMES, grads, ref_grads):
        assert rms_ratio(g, w) < bar_grad, name


def test_calls_it_does_not_apply_to_run_uncut(monkeypatch):
    """T not a multiple of segments x chunk, and varlen calls, keep one segment per sequence."""
    monkeypatch.setenv("TORCH_DPLR_TIME_SEGMENTS", "4")
    q = torch.zeros(1, 200, 2, 32)
    assert time_parallel.segments_for(q, None, 64) == 1
    assert time_parallel.segments_for(q, torch.tensor([0, 200]), 16) == 1
    assert time_parallel.segments_for(torch.zeros(1, 256, 2, 32), None, 64) == 4
    monkeypatch.delenv("TORCH_DPLR_TIME_SEGMENTS")
    assert time_parallel.segments_for(torch.zeros(1, 256, 2, 32), None, 64) == 1


@pytest.mark.parametrize("value", ["two", "0", "-3"])
def test_a_bad_setting_raises(monkeypatch, value):
    monkeypatch.setenv("TORCH_DPLR_TIME_SEGMENTS", value)
    x = _inputs(1, 128, 2, 32, 32, torch.float32)
    with pytest.raises(ValueError, match="TORCH_DPLR_TIME_SEGMENTS"):
        torch_dplr.chunk_dplr_delta_rule(*(x[n] for n in NAMES[:6]))


def test_segmented_call_compiles_as_one_graph(monkeypatch):
    monkeypatch.setenv("TORCH_DPLR_TIME_SEGMENTS", "2")
    x = _inputs(1, 128, 2, 32, 32, torch.float32)
    args = [x[n] for n in NAMES[:6]]

    def fn(*tensors):
        return torch_dplr.chunk_dplr_delta_rule(*tensors, chunk_size=32, output_final_state=True)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    for got, want in zip(compiled(*args), fn(*args)):
        torch.testing.assert_close(got, want)
