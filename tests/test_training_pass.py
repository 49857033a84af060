"""The two-op training pass (``dplr::chunk_fwd`` / ``dplr::chunk_bwd``,
``torch_dplr.ops.dataflow``, ``TORCH_DPLR_TRAINING_PASS=split``).

* Through the public function, the split pass gives the stage ops' o, final state and every
  gradient (fp64: the same arithmetic, so equal to round-off), rect and varlen, chunks 16 / 32
  / 64, with and without an initial state, a bound, a final-state gradient.
* The ops' CUDA bodies at K = 32 (the Triton split kernels) run on CPU tensors under Triton's
  interpreter and meet the suite's bf16 bars against the fp64 recurrence, a broken bound and
  unbounded gates included; their stage fallback (fp32 here) equals the PyTorch kernel.
  Where the TileLang stage kernels apply the bodies call them instead: their launches are
  checked on the CPU in tests/test_launch_args.py.
* A bad ``TORCH_DPLR_TRAINING_PASS`` names the variable and the choices.

opcheck covers both ops (tests/test_opcheck.py), the policies and compile
(compile_tests/test_policies.py, compile_tests/test_fullgraph.py).
"""
from __future__ import annotations

import os

import pytest
import torch

import torch_dplr
from torch_dplr.ops import dataflow
from torch_dplr.testing import TOLERANCES, make_inputs, recurrence_oracle, rms_ratio

NAMES = "q k v a b gk initial_state".split()


def _call(x, cu, C, bound, with_h0, mode, monkeypatch, do=None, dht=None):
    """o, final state and the gradients of every input through the public function."""
    monkeypatch.setenv(dataflow.TRAINING_PASS_VAR, mode)
    leaves = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
    o, ht = torch_dplr.chunk_dplr_delta_rule(
        *(leaves[n] for n in NAMES[:6]), initial_state=leaves["initial_state"] if with_h0 else None,
        output_final_state=True, chunk_size=C, lower_bound=bound,
        cu_seqlens=None if cu is None else torch.tensor(cu, device=x["q"].device))
    do = torch.randn_like(o) if do is None else do
    dht = torch.randn_like(ht) if dht is None else dht
    torch.autograd.backward((o, ht), (do, dht))
    used = NAMES if with_h0 else NAMES[:6]
    return [o, ht, *(leaves[n].grad for n in used)], do, dht


@pytest.mark.parametrize("C", [16, 32, 64])
@pytest.mark.parametrize("cu", [None, [0, 1, 40, 40, 150]], ids=["rect", "varlen"])
@pytest.mark.parametrize("with_h0,bound", [(True, -0.6065), (False, None)],
                         ids=["h0-bound", "no_h0-no_bound"])
def test_split_pass_equals_the_stages(C, cu, with_h0, bound, monkeypatch):
    B, T = (2, 70) if cu is None else (1, 150)
    x = make_inputs(B, T, 2, 16, dtype=torch.float64, seed=C,
                    num_states=B if cu is None else len(cu) - 1)
    torch.manual_seed(0)
    stages, do, dht = _call(x, cu, C, bound, with_h0, "stages", monkeypatch)
    split, _, _ = _call(x, cu, C, bound, with_h0, "split", monkeypatch, do, dht)
    for i, (got, want) in enumerate(zip(split, stages)):
        assert torch.isfinite(got).all() and rms_ratio(got, want) < 1e-12, i


def test_split_pass_runs_the_two_ops(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    x = make_inputs(2, 40, 2, 16, dtype=torch.float64)
    calls = Calls()
    with calls:
        _call(x, None, 16, None, True, "split", monkeypatch)
    dplr = {n for n in calls.names if n.startswith("dplr.")}
    assert dplr == {"dplr.chunk_tables", "dplr.chunk_fwd", "dplr.chunk_bwd"}


def test_unknown_training_pass_raises(monkeypatch):
    monkeypatch.setenv(dataflow.TRAINING_PASS_VAR, "fused")
    x = make_inputs(1, 20, 1, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="TORCH_DPLR_TRAINING_PASS.*stages.*split"):
        torch_dplr.chunk_dplr_delta_rule(*(x[n].requires_grad_() for n in NAMES[:6]))


# ------------------------------------------------------------------ the CUDA bodies, interpreted

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter is on only without a GPU (conftest.py); tests/test_cuda_triton.py "
           "runs the kernels on the GPU")


def _cuda_bodies(x, cu, C, bound, do, dht):
    """o, ht and every gradient from the ops' CUDA functions called on CPU tensors."""
    B, T = x["q"].shape[:2]
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    tables = torch.ops.dplr.chunk_tables(cu_t, B, T, C)
    args = [x[n] for n in NAMES]
    o, ht, states = dataflow.chunk_fwd_cuda(*args, cu_t, 0.25, C, bound, True, tables)
    grads = dataflow.chunk_bwd_cuda(*args, states, cu_t, do, dht, 0.25, C, bound, True, True,
                                    tables)
    return [o, ht], list(grads)


@interpreted
@pytest.mark.parametrize("case", [
    (1, 130, [0, 3, 64, 130], 64, dict(spikes=True), -0.6065),  # a broken bound, varlen
    (2, 70, None, 16, dict(gates="unbounded"), float("-inf")),
])
def test_cuda_bodies_meet_the_bars(case):
    """The Triton split kernels behind the ops against the fp64 recurrence: o, final state
    and every gradient within the suite's bf16 bars."""
    B, T, cu, C, options, bound = case
    x = make_inputs(B, T, 2, 32, dtype=torch.bfloat16, seed=4,
                    gates=options.get("gates", "rwkv7"),
                    num_states=B if cu is None else len(cu) - 1)
    if options.get("spikes"):
        x["gk"][0, 5::29, 0, ::7] = -1e4
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    assert dataflow.runs_split_kernels(x["q"], x["v"], x["gk"], cu_t, C)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen).to(x["v"].dtype)
    dht = torch.randn(x["initial_state"].shape, generator=gen)
    outs, grads = _cuda_bodies(x, cu, C, bound, do, dht)
    leaves = [x[n].detach().double().requires_grad_() for n in NAMES]
    ref_o, ref_ht = recurrence_oracle(*leaves[:6], 0.25, leaves[6],
                                      None if cu is None else torch.tensor(cu))
    ref_grads = torch.autograd.grad((ref_o, ref_ht), leaves, (do.double(), dht.double()))
    bar_out, bar_grad = TOLERANCES[torch.bfloat16]
    for name, got, want in zip(("o", "ht"), outs, (ref_o, ref_ht)):
        assert torch.isfinite(got).all() and rms_ratio(got, want) < bar_out, name
    for name, got, want in zip(NAMES, grads, ref_grads):
        assert torch.isfinite(got).all() and rms_ratio(got, want) < bar_grad, name


def test_cuda_bodies_fall_back_to_the_stages():
    """Where the split kernels do not apply (fp32 data here) the CUDA bodies run the stage ops
    in sequence: the PyTorch kernels' results exactly."""
    x = make_inputs(1, 50, 2, 8, dtype=torch.float32, num_states=3)
    cu = [0, 20, 21, 50]
    assert not dataflow.runs_split_kernels(x["q"], x["v"], x["gk"], torch.tensor(cu), 32)
    do, dht = torch.randn_like(x["v"]), torch.randn_like(x["initial_state"])
    outs, grads = _cuda_bodies(x, cu, 32, -0.6065, do, dht)
    cu_t = torch.tensor(cu)
    args = [x[n] for n in NAMES]
    o, ht, states = dataflow.chunk_fwd_reference(*args, cu_t, 0.25, 32, -0.6065, True)
    want = dataflow.chunk_bwd_reference(*args, states, cu_t, do, dht, 0.25, 32, -0.6065, True,
                                        True)
    for got, ref in zip([*outs, *grads], [o, ht, *want]):
        assert torch.equal(got, ref)


# ------------------------------------------------------------------ GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("C", [16, 32, 64])
@pytest.mark.parametrize("cu,gate_scale", [(None, 1.0), ([0, 5, 1500, 1501, 4096], 10.0)],
                         ids=["rect", "varlen-broken-bound"])
def test_split_pass_on_the_gpu(C, cu, gate_scale, monkeypatch):
    """On the GPU (the TileLang stage kernels inside the two ops at D 64) against the same
    call in fp64 (the stage ops' PyTorch kernels): every output and gradient finite and within
    the bf16 bars, with RWKV-7 gates (times ``gate_scale``: 10 breaks the declared bound)."""
    B, T = (2, 2048) if cu is None else (1, 4096)
    x = make_inputs(B, T, 4, 64, dtype=torch.bfloat16, seed=C, device="cuda",
                    num_states=B if cu is None else len(cu) - 1)
    x["gk"] = x["gk"] * gate_scale
    torch.manual_seed(0)
    got, do, dht = _call(x, cu, C, -0.6065, True, "split", monkeypatch)
    x64 = {n: x[n].double() for n in NAMES}
    ref, _, _ = _call(x64, cu, C, -0.6065, True, "stages", monkeypatch, do.double(),
                      dht.double())
    bar_out, bar_grad = TOLERANCES[torch.bfloat16]
    for i, (g, w) in enumerate(zip(got, ref)):
        assert torch.isfinite(g).all() and rms_ratio(g, w) < (bar_out if i < 2 else bar_grad), i
