"""A declared ``lower_bound`` that the gates break never changes the result on the GPU.

RWKV-7 gates ``-0.6065 sigmoid(5x)`` scaled by 1, 2, 10 and 100 (and a few spikes at -1e4):
every kernel configuration of the chunked call (chunk 16/32/64, K 64/128, rect with a state
and varlen without, training and no-grad, the stage pass and the two-op pass) with
``lower_bound=-0.6065`` must equal the same call with no bound on the exact schemes
(``exact_intra_schemes``) within the suite's bars, with finite outputs, final state and
gradients; so must the call with no bound as it runs by default (at chunks 16 and 32 the
centred schemes, checked chunk by chunk); the per-token path must match the fp64 recurrence.
Skipped without a GPU.
"""
import pytest
import torch

import torch_dplr
from torch_dplr.ops import fused
from torch_dplr.testing import (GRAD_NAMES, RWKV7_BOUND, TOLERANCES, exact_intra_schemes,
                                forbid_pytorch_stages, make_gates, make_inputs,
                                recurrence_oracle, rms_ratio)

pytestmark = pytest.mark.cuda

FACTORS = ("1", "2", "10", "100", "spikes")
# rect: 9 sequences x 16 heads and varlen: 10 sequences x 16 heads fill the H200's 132 SMs, so
# the no-grad calls at C = 64, K = 64 run the fused kernel
RECT = dict(B=9, T=200)
VARLEN_CU = [0, 1, 70, 200, 333, 400, 555, 640, 777, 900, 1000]
H = 16


def scaled_gates(shape, factor: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    gk = RWKV7_BOUND * torch.sigmoid(5 * torch.randn(shape, generator=gen))
    if factor == "spikes":  # a few gates far below the bound, in different heads and chunks
        flat = gk.view(-1)
        flat[torch.randint(0, flat.numel(), (8,), generator=gen)] = -1e4
        return gk
    return gk * float(factor)


def inputs(layout: str, K: int, factor: str, dtype=torch.bfloat16, seed=0):
    if layout == "rect":
        B, T, N, cu = RECT["B"], RECT["T"], RECT["B"], None
    else:
        B, T, N, cu = 1, VARLEN_CU[-1], len(VARLEN_CU) - 1, VARLEN_CU
    inp = make_inputs(B, T, H, K, dtype=dtype, seed=seed, num_states=N, device="cuda")
    inp["gk"] = scaled_gates((B, T, H, K), factor, seed).cuda()
    if layout != "rect":
        inp["initial_state"] = None
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    return inp, cu_t


def _offsets(cu):
    return torch.empty(0, dtype=torch.int64, device="cuda") if cu is None else cu


def call(inp, cu, chunk_size, lower_bound, grad: bool):
    names = [n for n in GRAD_NAMES if inp[n] is not None]
    leaves = {n: inp[n].detach().clone().requires_grad_(grad) for n in names}
    o, ht = torch_dplr.chunk_dplr_delta_rule(
        leaves["q"], leaves["k"], leaves["v"], leaves["a"], leaves["b"], leaves["gk"],
        initial_state=leaves.get("initial_state"), output_final_state=True, cu_seqlens=cu,
        chunk_size=chunk_size, lower_bound=lower_bound)
    result = {"o": o.detach(), "final_state": ht.detach()}
    if grad:
        gen = torch.Generator(device="cuda").manual_seed(7)
        do = torch.randn(o.shape, generator=gen, device="cuda").to(o.dtype)
        dht = torch.randn(ht.shape, generator=gen, device="cuda")
        grads = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(),
                                    [leaves[n] for n in names])
        result.update({"d" + n: g for n, g in zip(names, grads)})
    return result


def assert_same_as_unbounded(bounded, unbounded, dtype):
    out_tol, grad_tol = TOLERANCES[dtype]
    for name, x in bounded.items():
        assert torch.isfinite(x).all(), f"{name}: non-finite with the bound declared"
        assert torch.isfinite(unbounded[name]).all(), f"{name}: non-finite without a bound"
        tol = out_tol if name in ("o", "final_state") else grad_tol
        err = rms_ratio(x, unbounded[name])
        assert err <= tol, f"{name}: {err:.2e} against the unbounded call (bar {tol})"


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", ["rect", "varlen"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
def test_broken_bound_gives_the_unbounded_result(grad, chunk_size, K, layout, factor):
    inp, cu = inputs(layout, K, factor)
    if not grad and chunk_size == 64 and K == 64:
        # the fused no-grad kernel is the path under test here
        assert fused.fused_kernel_applies(inp["q"], inp["v"], inp["gk"], _offsets(cu), 64,
                                          RWKV7_BOUND)
    with forbid_pytorch_stages():
        bounded = call(inp, cu, chunk_size, RWKV7_BOUND, grad)
        with exact_intra_schemes():
            unbounded = call(inp, cu, chunk_size, None, grad)
    assert_same_as_unbounded(bounded, unbounded, torch.bfloat16)


@pytest.mark.parametrize("factor", FACTORS + ("heavy",))
@pytest.mark.parametrize("layout", ["rect", "varlen"])
@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
def test_no_bound_checked_scheme_gives_the_exact_result(grad, chunk_size, layout, factor):
    """No bound declared: at chunks 16 and 32 the centred schemes run anyway, checked chunk by
    chunk, and must give the exact schemes' result ("heavy": the benchmark's heavy-tailed
    gates, down to -40 a token, whose chunks of 16 mostly stay in range)."""
    inp, cu = inputs(layout, 64, "1" if factor == "heavy" else factor)
    if factor == "heavy":
        gen = torch.Generator().manual_seed(3)
        inp["gk"] = make_gates(inp["gk"].shape, "unbounded", gen).cuda()
    with forbid_pytorch_stages():
        checked = call(inp, cu, chunk_size, None, grad)
        with exact_intra_schemes():
            exact = call(inp, cu, chunk_size, None, grad)
    assert_same_as_unbounded(checked, exact, torch.bfloat16)


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", ["rect", "varlen"])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_broken_bound_in_the_two_op_pass(chunk_size, layout, factor, monkeypatch):
    """The two-op training pass (``TORCH_DPLR_TRAINING_PASS=split``: the stage kernels inside
    two ops at K = 64) with the bound declared against the stage pass without one."""
    from torch_dplr.ops import dataflow

    inp, cu = inputs(layout, 64, factor)
    assert not dataflow.runs_split_kernels(inp["q"], inp["v"], inp["gk"], _offsets(cu),
                                           chunk_size)
    with exact_intra_schemes():
        unbounded = call(inp, cu, chunk_size, None, True)
    monkeypatch.setenv(dataflow.TRAINING_PASS_VAR, "split")
    bounded = call(inp, cu, chunk_size, RWKV7_BOUND, True)
    assert_same_as_unbounded(bounded, unbounded, torch.bfloat16)


@pytest.mark.parametrize("factor", ["1", "10", "spikes"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_broken_bound_fp16(chunk_size, factor):
    """fp16: the bounded backward scheme has the narrowest range (C = 16 only)."""
    inp, cu = inputs("rect", 64, factor, dtype=torch.float16)
    with forbid_pytorch_stages():
        bounded = call(inp, cu, chunk_size, RWKV7_BOUND, True)
        with exact_intra_schemes():
            unbounded = call(inp, cu, chunk_size, None, True)
    assert_same_as_unbounded(bounded, unbounded, torch.float16)


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("T", [1, 37, 300])
def test_per_token_path_is_exact_for_any_gate(T, factor):
    """fused_recurrent (per-token kernel up to 64 tokens a sequence, the chunked sweep beyond)
    against the fp64 recurrence, training and no-grad."""
    inp = make_inputs(2, T, H, 64, dtype=torch.bfloat16, seed=1, device="cuda")
    inp["gk"] = scaled_gates((2, T, H, 64), factor, 1).cuda()
    names = list(GRAD_NAMES)
    leaves = {n: inp[n].detach().clone().requires_grad_() for n in names}
    o, ht = torch_dplr.fused_recurrent_dplr_delta_rule(
        *(leaves[n] for n in ("q", "k", "v", "a", "b", "gk")), scale=0.125,
        initial_state=leaves["initial_state"], output_final_state=True)
    o_ref, ht_ref = recurrence_oracle(*(inp[n].double() for n in ("q", "k", "v", "a", "b", "gk")),
                                      0.125, inp["initial_state"].double())
    out_tol, grad_tol = TOLERANCES[torch.bfloat16]
    for name, x, ref in (("o", o, o_ref), ("final_state", ht, ht_ref)):
        assert torch.isfinite(x).all(), name
        assert rms_ratio(x, ref) <= out_tol, (name, rms_ratio(x, ref))
    grads = torch.autograd.grad(o.float().sum() + ht.sum(), [leaves[n] for n in names])
    for name, g in zip(names, grads):
        assert torch.isfinite(g).all(), f"d{name}"
    with torch.no_grad():
        o_ng, _ = torch_dplr.fused_recurrent_dplr_delta_rule(
            *(inp[n] for n in ("q", "k", "v", "a", "b", "gk")), scale=0.125,
            initial_state=inp["initial_state"], output_final_state=True)
    assert rms_ratio(o_ng, o_ref) <= out_tol


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_nan_gate_stays_in_its_sequence_and_head(chunk_size):
    """A NaN gate is the caller's bug: it may give NaN in its own (sequence, head), nowhere
    else, on the bounded GPU path (training and, at C = 64, the fused no-grad kernel): not in
    the previous sequence, whose last chunk shares its tile rows with it."""
    inp, cu = inputs("varlen", 64, "1")
    inp["gk"][0, 100, 3, 5] = float("nan")  # sequence 2 (tokens 70-199), head 3
    clean, _ = inputs("varlen", 64, "1")
    for grad in (True, False):
        got = call(inp, cu, chunk_size, RWKV7_BOUND, grad)
        want = call(clean, cu, chunk_size, RWKV7_BOUND, grad)
        for name, x in got.items():
            x, ref = x.clone(), want[name]
            if name == "final_state":
                x[2, 3] = ref[2, 3]
            else:  # o and the input gradients: token rows of sequence 2, head 3
                x[0, 70:200, 3] = ref[0, 70:200, 3]
            assert torch.isfinite(x).all(), f"{name}: NaN outside the NaN gate's pair"
            out_tol, grad_tol = TOLERANCES[torch.bfloat16]
            assert rms_ratio(x, ref) <= (out_tol if name in ("o", "final_state") else grad_tol)
