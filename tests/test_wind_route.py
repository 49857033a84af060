"""wind_rwkv's column on the CPU: our arguments in its conventions, checked against torch_dplr
through a recurrence written in those conventions; its refusals; the harness's wind fields.

The recurrence follows what wind_rwkv's ``chunked_cuda`` computes (benchmarks/wind_route.py):
state ``s`` ``[B, H, V, K]``, ``s_t = s_{t-1} diag(exp(-exp(w_t))) + (s_{t-1} a_t) b_tᵀ +
v_t k_tᵀ``, ``y_t = s_t r_t``.
"""
import os
from pathlib import Path

import pytest
import torch

import torch_dplr
from benchmarks import cells, harness, inputs, wind_route
from torch_dplr.testing import make_gates, make_inputs, rms_ratio

REPO = Path(__file__).resolve().parent.parent
NAMES = ("q", "k", "v", "a", "b", "gk", "initial_state")


def wind_recurrence(r, w, k, v, a, b, s0, chunk_starts=None):
    """fp64 per token in wind's conventions; ``chunk_starts`` collects the state before each
    16-token chunk (what its forward stores for the backward)."""
    r, w, k, v, a, b, s = (x.double() for x in (r, w, k, v, a, b, s0))
    decay = torch.exp(-torch.exp(w))
    ys = []
    for t in range(r.shape[1]):
        if chunk_starts is not None and t % wind_route.CHUNK == 0:
            chunk_starts.append(s)
        s_a = torch.einsum("bhvk,bhk->bhv", s, a[:, t])
        s = (s * decay[:, t, :, None, :] + torch.einsum("bhv,bhk->bhvk", s_a, b[:, t])
             + torch.einsum("bhv,bhk->bhvk", v[:, t], k[:, t]))
        ys.append(torch.einsum("bhvk,bhk->bhv", s, r[:, t]))
    return torch.stack(ys, 1), s


def wind_standin(r, w, k, v, a, b, s0):
    """Stands in for ``attn_chunked_cuda``: same arguments, bf16 results, differentiable."""
    y, sT = wind_recurrence(r, w, k, v, a, b, s0)
    return y.to(r.dtype), sT.to(s0.dtype)


def _ours(inp, scale, leaves):
    return torch_dplr.chunk_dplr_delta_rule(*(leaves[n] for n in NAMES[:6]), scale=scale,
                                            initial_state=leaves["initial_state"],
                                            output_final_state=True, chunk_size=16)


def _grads(outs, leaves, cotangents):
    return dict(zip(NAMES, torch.autograd.grad(outs, [leaves[n] for n in NAMES], cotangents)))


def test_decay_of_converted_gates_is_ours():
    gk = torch.cat([make_gates((4096,), "rwkv7", torch.Generator().manual_seed(0)),
                    make_gates((4096,), "unbounded", torch.Generator().manual_seed(1)),
                    torch.tensor([0.0, -1e-7, wind_route.LOG_DECAY_FLOOR])]).double()
    q = torch.zeros(1, gk.numel(), 1, 1, dtype=torch.float64)
    w = wind_route.to_wind(q, q, q, q, q, gk.view(q.shape), 1.0, dtype=torch.float64)[1]
    assert torch.allclose(torch.exp(-torch.exp(w)).flatten(), torch.exp(gk), rtol=1e-12, atol=0)
    assert torch.exp(-torch.exp(w)).flatten()[-3] == 1.0  # gk 0: w -inf, no decay
    w16 = wind_route.to_wind(q, q, q, q, q, gk.view(q.shape).float(), 1.0)[1].flatten()
    assert w16.dtype == torch.bfloat16
    # bf16 w carries -gk = exp(w) to a relative |w|·2^-9 (2^-8 with the margin of exp)
    finite = gk < 0
    rel = (torch.exp(w16.double()[finite]) / -gk[finite] - 1).abs()
    assert bool((rel <= w16.double()[finite].abs() * 2 ** -8 + 1e-6).all())


def test_state_layout_round_trip():
    h = torch.randn(3, 2, 4, 6)  # K != V, so a missing or doubled transpose shows
    s = wind_route.state_to_wind(h, torch.float32)
    assert s.shape == (3, 2, 6, 4) and s.is_contiguous()
    assert s[1, 0, 5, 2] == h[1, 0, 2, 5] and s[2, 1, 0, 3] == h[2, 1, 3, 0]
    assert torch.equal(wind_route.state_from_wind(s), h)
    s16 = wind_route.state_to_wind(h)
    assert s16.dtype == torch.bfloat16 and torch.equal(wind_route.state_from_wind(s16), h.bfloat16().float())


@pytest.mark.parametrize("gates", ["rwkv7", "unbounded"])
def test_wind_recurrence_on_converted_inputs_is_torch_dplr_fp64(gates):
    """The mapping itself, without rounding: o, the final state and every input's gradient
    (through the conversion, the final-state cotangent transposed) agree to fp64 precision."""
    B, T, H, D = 2, 32, 2, 16
    inp = make_inputs(B, T, H, D, dtype=torch.float64, gates=gates, seed=3)
    leaves = {n: inp[n].clone().requires_grad_() for n in NAMES}
    scale = D ** -0.5  # not 1: the scale folded into r is checked too
    o, ht = _ours(inp, scale, leaves)
    args = wind_route.to_wind(*(leaves[n] for n in NAMES[:6]), scale, leaves["initial_state"],
                              dtype=torch.float64)
    y, sT = wind_recurrence(*args)
    assert rms_ratio(y, o) < 1e-12 and rms_ratio(wind_route.state_from_wind(sT, torch.float64), ht) < 1e-12
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    ours = _grads([o, ht], leaves, [do, dht])
    theirs = _grads([y, sT], leaves, [do, wind_route.state_to_wind(dht, torch.float64)])
    for name in NAMES:
        assert rms_ratio(theirs[name], ours[name]) < 1e-10, name


def test_bf16_conversion_costs_only_rounding():
    """Through bf16 (w, r, s0 rounded, as the kernel takes them) the wind recurrence stays within
    bf16's error bars of torch_dplr's fp64 result on the same inputs."""
    B, T, H, D = 2, 48, 2, 16
    inp = make_inputs(B, T, H, D, dtype=torch.bfloat16, seed=5)
    wide = {n: x.double() for n, x in inp.items()}
    o, ht = _ours(wide, 1.0, wide)
    y, sT = wind_recurrence(*wind_route.to_wind(*(inp[n] for n in NAMES[:6]), 1.0, inp["initial_state"]))
    assert rms_ratio(y.bfloat16(), o) < 7e-3
    assert rms_ratio(wind_route.state_from_wind(sT.bfloat16()), ht) < 7e-3


def test_refusals():
    design = cells.Cell(cells.DESIGN, 64, "rwkv7", True, "fwd")
    assert wind_route.refusal(design, 64) is None
    other = wind_route.refusal(design, 128)
    assert "head dim 64" in other and "--head-dim 64" in other
    assert "T=40" in wind_route.refusal(cells.Cell(cells.Shape(1, 40, 1, 16), 16, "rwkv7", False, "fwd"), 16)
    varlen = wind_route.refusal(cells.Cell(cells.SHAPES[-1], 16, "rwkv7", False, "fwd"), 64)
    assert varlen.startswith("varlen") and "of 65 offsets are not multiples of 16" in varlen
    assert "unbounded" in wind_route.refusal(cells.Cell(cells.DESIGN, 16, "unbounded", False, "fwd"), 64)
    huge = cells.Cell(cells.Shape(64, 65536, 32, 128), 64, "rwkv7", False, "fwd")
    assert "32-bit" in wind_route.refusal(huge, 128)
    # with the tensors: their dtype and their gates' actual range
    tiny = cells.Shape(1, 32, 1, 16)
    cell = cells.Cell(tiny, 16, "rwkv7", True, "fwd")
    assert wind_route.refusal(cell, 16, inputs.make(tiny, "rwkv7", "cpu")) is None
    assert "bf16 only" in wind_route.refusal(cell, 16, inputs.make(tiny, "rwkv7", "cpu", dtype=torch.float32))
    steep = inputs.make(tiny, "rwkv7", "cpu")
    steep.gk[0, :16, 0, 3] = -6.0  # one channel's chunk: -96 in all
    assert "sum to -96" in wind_route.refusal(cell, 16, steep)
    aligned = inputs.make(cells.Shape(1, 64, 1, 16, N=2), "rwkv7", "cpu")
    aligned.cu_seqlens_cpu = torch.tensor([0, 32, 64])
    assert "not wired" in wind_route.refusal(cells.Cell(cells.Shape(1, 64, 1, 16, N=2), 16, "rwkv7",
                                                        False, "fwd"), 16, aligned)


def _spy(seen):
    def fn(*args):
        # what wind's wrapper asserts: bf16, contiguous, one shape for the six token inputs
        assert all(x.dtype == torch.bfloat16 and x.is_contiguous() for x in args)
        assert len({x.shape for x in args[:6]}) == 1
        seen.append((torch.is_grad_enabled(), [x.requires_grad for x in args]))
        return wind_standin(*args)
    return fn


@pytest.mark.parametrize("state", [True, False])
def test_measure_cell_times_wind_beside_torch_dplr(state):
    seen = []
    wind = wind_route.Wind(16, _spy(seen), "test")
    timer = harness.Timer("cpu", reps=1, warmup=0)
    shape = cells.Shape(1, 32, 1, 16)
    inp = inputs.make(shape, "rwkv7", "cpu")
    for mode, policy in (("fwd", "none"), ("fwd_bwd", "none"), ("fwd_bwd", cells.SHIPPED_POLICY)):
        seen.clear()
        cell = cells.Cell(shape, 16, "rwkv7", state, mode, policy)
        record = harness.measure_cell(cell, inp, inp.leaves(), timer, None, {"fla_skipped": "x"},
                                      {"device": "cpu"}, wind, {})
        assert not any(k.endswith("_error") for k in record), record
        assert record["wind_ms"] > 0 and record["wind_reps"] == 1 and "wind_refusal" not in record
        assert record["ratio_wind"] == round(record["wind_ms"] / record["torch_dplr_ms"], 3)
        assert record["wind_setting"] == wind_route.SETTING[mode]
        if mode == "fwd":
            assert all(not grad for grad, _ in seen)
            diffs = record["diff_vs_wind"]
            assert diffs["o"] < 1e-2
            assert diffs["final_state"] < 1e-2 if state else "final_state" not in diffs
        else:  # every wind input is differentiated; s0 only when it is the cell's initial state
            assert "diff_vs_wind" not in record
            assert all(grad and flags == [True] * 6 + [state] for grad, flags in seen)


def test_measure_cell_records_why_wind_did_not_run():
    timer = harness.Timer("cpu", reps=1, warmup=0)
    shape = cells.Shape(1, 32, 1, 16)
    inp = inputs.make(shape, "rwkv7", "cpu")
    cell = cells.Cell(shape, 16, "rwkv7", True, "fwd")
    refused = harness.measure_cell(cell, inp, inp.leaves(), timer, None, {}, {},
                                   wind_route.Wind(64, wind_standin), {})
    assert "head dim 16" in refused["wind_refusal"]
    absent = harness.measure_cell(cell, inp, inp.leaves(), timer, None, {}, {}, None,
                                  {"wind_skipped": "--no-wind"})
    for record in (refused, absent):
        assert record["wind_ms"] is None and record["wind_peak_mb"] is None and record["ratio_wind"] is None
        assert set(harness.REQUIRED) <= set(record) and record["torch_dplr_ms"] > 0
    assert absent["wind_skipped"] == "--no-wind"


def test_load_says_why(monkeypatch, tmp_path):
    todo = [cells.Cell(cells.DESIGN, 64, "rwkv7", True, "fwd")]
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert wind_route.load(todo, torch.device("cpu")) == (None, {"wind_skipped": "wind_rwkv needs CUDA"})
    assert wind_route.load(todo, cuda, skip="--no-wind") == (None, {"wind_skipped": "--no-wind"})
    monkeypatch.delenv(wind_route.ENV, raising=False)
    assert "not set" in wind_route.load(todo, cuda)[1]["wind_skipped"]
    monkeypatch.setenv(wind_route.ENV, str(tmp_path))
    assert wind_route.load(todo, cuda)[1]["wind_error"].startswith("load failed: ")
    with pytest.raises(ImportError, match="holds neither"):
        wind_route.Wind.load(64, root=tmp_path, require_cuda=False)
    assert wind_route.head_dim_of(todo, None) == 64 and wind_route.head_dim_of(todo, 128) == 128


def test_head_dim_filter(capsys):
    argv = ["--device", "cpu", "--list", "--modes", "fwd,fwd_bwd,first_call"]
    assert harness.main(argv) == 0
    every = capsys.readouterr().out.split()
    assert harness.main(argv + ["--head-dim", "128"]) == 0
    d128 = capsys.readouterr().out.split()
    assert d128 and all("-D128/" in c for c in d128)  # the first_call cell (D64) left out too
    assert d128 == [c for c in every if "-D128/" in c]


# --- wind_rwkv's own Python wrapper over a stand-in kernel (needs its source folder) ---------

def _wind_source():
    for root in (os.environ.get(wind_route.ENV), REPO / ".probe" / "wind_rwkv", REPO / ".gpu" / "wind_rwkv"):
        try:
            if root:
                return wind_route.op_folder(root)
        except ImportError:
            continue
    return None


@pytest.fixture
def standin_kernels(monkeypatch):
    """CPU kernels under wind's op names and schemas (its chunked_cuda.cpp), computing the
    recurrence: with them registered its loader builds nothing."""
    monkeypatch.setattr(wind_route, "_built_for", None)
    lib = torch.library.Library("wind_chunked_cuda", "DEF")
    lib.define("forward(Tensor w, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor s0, "
               "Tensor(a!) y, Tensor? s, Tensor(c!) sT) -> ()")
    lib.define("backward(Tensor w, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor dy, "
               "Tensor s, Tensor dsT, Tensor(a!) dw, Tensor(b!) dq, Tensor(c!) dk, Tensor(d!) dv, "
               "Tensor(e!) da, Tensor(f!) db, Tensor(g!) ds0) -> ()")

    def forward(w, q, k, v, a, b, s0, y, s, sT):
        starts = []
        out, last = wind_recurrence(q, w, k, v, a, b, s0, starts)
        y.copy_(out)
        sT.copy_(last)
        if s is not None:
            s.copy_(torch.stack(starts, 2))

    def backward(w, q, k, v, a, b, dy, s, dsT, *grads):
        with torch.enable_grad():
            xs = [x.detach().double().requires_grad_() for x in (w, q, k, v, a, b, s[:, :, 0])]
            y, sT = wind_recurrence(xs[1], xs[0], *xs[2:])
            for out, g in zip(grads, torch.autograd.grad([y, sT], xs, [dy.double(), dsT.double()])):
                out.copy_(g)

    lib.impl("forward", forward, "CPU")
    lib.impl("backward", backward, "CPU")
    yield
    lib._destroy()


@pytest.mark.skipif(_wind_source() is None, reason="no wind_rwkv source folder ($TORCH_DPLR_WIND_RWKV, "
                    ".probe/wind_rwkv or .gpu/wind_rwkv)")
def test_wind_wrapper_on_prepared_arguments(standin_kernels):
    """wind_rwkv's attn_chunked_cuda (its autograd Function and argument checks) on the
    arguments the harness prepares gives torch_dplr's o, final state and gradients."""
    wind = wind_route.Wind.load(16, root=_wind_source(), require_cuda=False)
    shape = cells.Shape(1, 32, 2, 16)
    inp = inputs.make(shape, "rwkv7", "cpu")
    cell = cells.Cell(shape, 16, "rwkv7", True, "fwd_bwd")
    leaves = inp.leaves()
    prepared = wind.prepare(cell, leaves, 1.0)
    wind.step(prepared)()  # the timed call runs
    # the same call with gradients back to our inputs (prepare detaches: convert here instead)
    args = wind_route.to_wind(leaves.q, leaves.k, leaves.v, leaves.a, leaves.b, leaves.gk, 1.0, leaves.h0)
    y, sT = wind.fn(*args)
    wide = {n: getattr(inp, m).double().requires_grad_() for n, m in zip(NAMES, "q k v a b gk h0".split())}
    o, ht = _ours(wide, 1.0, wide)
    assert rms_ratio(y, o) < 1e-2 and rms_ratio(wind_route.state_from_wind(sT), ht) < 1e-2
    wind_leaves = dict(zip(NAMES, (leaves.q, leaves.k, leaves.v, leaves.a, leaves.b, leaves.gk, leaves.h0)))
    theirs = _grads([y, sT], wind_leaves, [inp.do, wind_route.state_to_wind(inp.dht)])
    ours = _grads([o, ht], wide, [inp.do.double(), inp.dht.double()])
    for name in NAMES:
        assert rms_ratio(theirs[name], ours[name]) < 1e-2, name
