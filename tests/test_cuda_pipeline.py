"""The composed op on CUDA runs TileLang kernels end to end (skipped without a GPU).

- In every kernel configuration (bf16/fp16, K = V in {64, 128}, chunk 16/32/64, fp32 or
  input-dtype gates, bounded or unbounded, rect or varlen, with or without state) a forward +
  backward runs no PyTorch stage: the stage fallbacks are replaced by functions that fail.
- The result matches the fp64 per-token recurrence (every output and gradient) at real sizes,
  with small and large B·H, for every gate style and chunk size.
- A no-grad call (``dplr::chunk_fwd_fused``) runs the fused kernel where it applies and
  matches the training call's forward; with few (sequence, head) pairs it stays staged.
- opcheck at kernel shapes (the samples in op_samples.py are too small to reach the kernels).
- torch.compile on kernel shapes: fullgraph forward+backward equal to eager, a new length or
  varlen layout compiles nothing, checkpoint policies give eager's gradients, CUDA graphs.
"""
import pytest
import torch

import torch_dplr
from test_parity import assert_within
from torch_dplr import policies
from torch_dplr.testing import RWKV7_BOUND, forbid_pytorch_stages, make_inputs, parity_errors

# a kernel that cannot be built falls back with a RuntimeWarning: here that is a failure
pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("error:torch_dplr:RuntimeWarning")]

DEV = "cuda"


def _call(inp, chunk_size, lower_bound, cu=None, state=True):
    names = ["q", "k", "v", "a", "b", "gk"] + (["initial_state"] if state else [])
    leaves = {n: inp[n].detach().clone().requires_grad_() for n in names}
    o, ht = torch_dplr.chunk_dplr_delta_rule(
        *(leaves[n] for n in names[:6]), initial_state=leaves.get("initial_state"),
        output_final_state=state, cu_seqlens=cu, chunk_size=chunk_size, lower_bound=lower_bound)
    loss = o.float().square().sum() + (ht.square().sum() if state else 0)
    loss.backward()
    return o, ht, {n: t.grad for n, t in leaves.items()}


KERNEL_CONFIGS = [(C, K, dtype, gate_dtype)
                  for C in (16, 32, 64) for K in (64, 128)
                  for dtype, gate_dtype in ((torch.bfloat16, torch.float32),
                                            (torch.float16, torch.float16))]


@pytest.mark.parametrize("C,K,dtype,gate_dtype", KERNEL_CONFIGS,
                         ids=lambda p: str(p).replace("torch.", ""))
@pytest.mark.parametrize("layout", ["rect_state", "varlen_no_state"])
def test_no_pytorch_stage_runs(C, K, dtype, gate_dtype, layout):
    bounded = (C + K) % 3 != 0  # both gate schemes across the configs
    inp = make_inputs(2, 300, 4, K, dtype=dtype, device=DEV, gates="rwkv7" if bounded else "unbounded")
    inp["gk"] = inp["gk"].to(gate_dtype)
    cu = None
    if layout == "varlen_no_state":
        inp = {n: x[:1] if n != "initial_state" else x for n, x in inp.items()}
        cu = torch.tensor([0, 1, 1, C + 3, 300], device=DEV)
    with forbid_pytorch_stages():
        o, ht, grads = _call(inp, C, RWKV7_BOUND if bounded else None, cu,
                             state=layout == "rect_state")
        # the no-grad call (dplr::chunk_fwd_fused; 8 (sequence, head) pairs: the staged ops)
        o_ng, _ = _call_no_grad(inp, C, RWKV7_BOUND if bounded else None, cu,
                                state=layout == "rect_state")
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(o_ng).all()
    for name, g in grads.items():
        assert g is not None and torch.isfinite(g).all(), name


def _call_no_grad(inp, chunk_size, lower_bound, cu=None, state=True):
    with torch.no_grad():
        return torch_dplr.chunk_dplr_delta_rule(
            *(inp[n] for n in ("q", "k", "v", "a", "b", "gk")),
            initial_state=inp["initial_state"] if state else None, output_final_state=state,
            cu_seqlens=cu, chunk_size=chunk_size, lower_bound=lower_bound)


# ---- the fused no-grad forward (dplr::chunk_fwd_fused) ---------------------------------------

def _fills_the_gpu(B, H):
    return B * H >= torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("dtype,gate_dtype", [(torch.bfloat16, torch.float32),
                                              (torch.float16, torch.float16)],
                         ids=["bf16_fp32gates", "fp16_fp16gates"])
@pytest.mark.parametrize("layout", ["rect_state", "varlen_no_state"])
def test_no_grad_call_runs_the_fused_kernel_and_matches_training_call(dtype, gate_dtype, layout,
                                                                      monkeypatch):
    """A no-grad public call at a shape that fills the GPU runs the fused kernel (the staged
    composition inside the op is made to fail, and no PyTorch stage runs); its o and final
    state equal the grad-enabled (staged) call's within the fused-vs-staged bars."""
    from torch_dplr.ops import fused
    from torch_dplr.testing import FUSED_VS_STAGED_TOL, rms_ratio

    B, H, cu = (3, 48, None) if layout == "rect_state" else (1, 32, [0, 1, 1, 64, 700, 1000])
    assert _fills_the_gpu(B if cu is None else len(cu) - 1, H)
    inp = make_inputs(B, 1000, H, 64, dtype=dtype, device=DEV, seed=3,
                      num_states=B if cu is None else len(cu) - 1)
    inp["gk"] = inp["gk"].to(gate_dtype)
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)
    state = layout == "rect_state"

    def staged_composition_ran(*args, **kwargs):
        raise AssertionError("dplr::chunk_fwd_fused composed the staged ops: the fused kernel "
                             "was not used")

    with forbid_pytorch_stages():
        o_train, ht_train, _ = _call(inp, 64, RWKV7_BOUND, cu_t, state=state)
        monkeypatch.setattr(fused, "_compose", staged_composition_ran)
        o, ht = _call_no_grad(inp, 64, RWKV7_BOUND, cu_t, state=state)
    torch.cuda.synchronize()
    assert o.dtype == o_train.dtype and o.shape == o_train.shape and not o.requires_grad
    tol = FUSED_VS_STAGED_TOL[dtype]
    errors = {"o": rms_ratio(o, o_train)}
    if state:
        assert ht.dtype == torch.float32 and ht.shape == ht_train.shape
        errors["ht"] = rms_ratio(ht, ht_train)
    print(f"no-grad (fused) vs training (staged) call, {layout} {dtype}: {errors}")
    assert all(e <= tol[n] for n, e in errors.items()), (errors, tol)


def test_no_grad_call_with_few_pairs_stays_staged():
    """Fewer (sequence, head) pairs than SMs: the fused op composes the staged kernels (the
    serial per-(sequence, head) walk would leave most SMs idle)."""
    from torch_dplr.ops import fused

    inp = make_inputs(1, 2048, 4, 64, dtype=torch.bfloat16, device=DEV)
    cu = torch.empty(0, dtype=torch.int64, device=DEV)
    assert not fused.fused_kernel_applies(inp["q"], inp["v"], inp["gk"], cu, 64, RWKV7_BOUND)
    with forbid_pytorch_stages():
        o, _ = _call_no_grad(inp, 64, RWKV7_BOUND, state=False)
        o_train, _, _ = _call(inp, 64, RWKV7_BOUND, state=False)
    torch.testing.assert_close(o, o_train.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("gates", ["rwkv7", "saturated", "unbounded"])
def test_parity_real_size_k128(chunk_size, gates):
    errors = parity_errors(1, 2048, 16, 128, dtype=torch.bfloat16, gates=gates,
                           chunk_size=chunk_size, device=DEV, seed=5,
                           lower_bound=RWKV7_BOUND if gates != "unbounded" else None)
    assert_within(errors, torch.bfloat16)


@pytest.mark.parametrize("B,H", [(8, 32), (1, 2)])  # large and small B·H
def test_parity_large_and_small_grid(B, H):
    errors = parity_errors(B, 2048, H, 64, dtype=torch.bfloat16, chunk_size=64, device=DEV,
                           seed=7, lower_bound=RWKV7_BOUND)
    assert_within(errors, torch.bfloat16)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_parity_varlen_k128_unbounded(chunk_size):
    cu = [0, 1, 1, 700, 701, 2048, 4096]
    errors = parity_errors(1, 4096, 16, 128, dtype=torch.bfloat16, gates="unbounded",
                           chunk_size=chunk_size, cu_seqlens=cu, device=DEV, seed=9)
    assert_within(errors, torch.bfloat16)


def test_parity_fp16_input_dtype_gates():
    def fn(q, k, v, a, b, gk, **kw):
        return torch_dplr.chunk_dplr_delta_rule(q, k, v, a, b, gk.half(), **kw)
    errors = parity_errors(2, 2048, 16, 64, dtype=torch.float16, chunk_size=32, device=DEV,
                           fn=fn, lower_bound=RWKV7_BOUND)
    assert_within(errors, torch.float16)


def test_no_state_at_all():
    errors = parity_errors(2, 2048, 16, 64, dtype=torch.bfloat16, chunk_size=64, device=DEV,
                           use_state=False, lower_bound=RWKV7_BOUND)
    assert_within(errors, torch.bfloat16)


# ---- opcheck at kernel shapes ----------------------------------------------------------------

def _kernel_shape_samples():
    for C, cu in ((16, None), (64, [0, 1, 70, 200])):
        inp = make_inputs(2 if cu is None else 1, 200, 2, 64, dtype=torch.bfloat16, device=DEV,
                          num_states=2 if cu is None else 3)
        cu_t = (torch.empty(0, dtype=torch.int64, device=DEV) if cu is None
                else torch.tensor(cu, dtype=torch.int32, device=DEV))
        q, k, v, a, b, gk, h0 = (inp[n] for n in "q k v a b gk initial_state".split())
        fwd = torch.ops.dplr.chunk_intra_fwd(q, k, a, b, gk, cu_t, 0.125, C, RWKV7_BOUND)
        gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = fwd
        A_inv, w, u = torch.ops.dplr.chunk_wy_fwd(A_ab, A_ak, ag, v, cu_t, C)
        o, ht, h, v_new = torch.ops.dplr.chunk_state_fwd(qg, kg, bg, w, u, v, A_qk, A_qb, gl, h0,
                                                         cu_t, C, True, True)
        rnd = lambda x: torch.randn_like(x.float()).to(x.dtype)  # noqa: E731
        yield "chunk_intra_fwd", (q.requires_grad_(), k, a, b, gk, cu_t, 0.125, C, RWKV7_BOUND)
        yield "chunk_intra_bwd", (q.detach(), k, a, b, gk, cu_t, gl, *map(rnd, fwd), 0.125, C,
                                  RWKV7_BOUND)
        yield "chunk_wy_fwd", (A_ab, A_ak, ag.requires_grad_(), v, cu_t, C)
        yield "chunk_wy_bwd", (A_inv, A_ak, ag.detach(), v, rnd(w), rnd(u), cu_t, C)
        yield "chunk_state_fwd", (qg, kg, bg, w, u, v, A_qk, A_qb, gl, h0, cu_t, C, True, True)
        yield "chunk_state_fwd", (qg, kg, bg, w, u, v, A_qk, A_qb, gl, h0.new_empty(0), cu_t, C,
                                  False, False)
        yield "chunk_state_bwd", (qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, rnd(o), rnd(ht),
                                  h0, cu_t, C, True, True)
        # few (sequence, head) pairs: the fused op composes the staged kernels
        yield "chunk_fwd_fused", (q.detach(), k, v, a, b, gk, h0, cu_t, 0.125, C, RWKV7_BOUND,
                                  True)
    # enough pairs to fill the GPU (H = 72, 2 sequences): the fused kernel
    inp = make_inputs(2, 200, 72, 64, dtype=torch.bfloat16, device=DEV)
    q, k, v, a, b, gk, h0 = (inp[n] for n in "q k v a b gk initial_state".split())
    cu_t = torch.empty(0, dtype=torch.int64, device=DEV)
    yield "chunk_fwd_fused", (q, k, v, a, b, gk, h0, cu_t, 0.125, 64, RWKV7_BOUND, True)
    yield "chunk_fwd_fused", (q, k, v, a, b, gk, h0.new_empty(0), cu_t, 0.125, 64, RWKV7_BOUND,
                              False)


def test_opcheck_kernel_shapes():
    with forbid_pytorch_stages():
        for name, args in _kernel_shape_samples():
            torch.library.opcheck(getattr(torch.ops.dplr, name).default, args)


# ---- torch.compile with the kernels --------------------------------------------------------

def _rwkv7(r, w, k, v, a, b, h0=None, cu=None):
    return torch_dplr.chunk_rwkv7(r, w, k, v, a, b, initial_state=h0, output_final_state=True,
                                  cu_seqlens=cu, lower_bound=RWKV7_BOUND, chunk_size=64)


def _leaves(T, B=2, H=6, K=64, seed=0):
    # H = 6 equals no sequence count + 1 below: Dynamo's duck sizing would tie H to N + 1
    inp = make_inputs(B, T, H, K, dtype=torch.bfloat16, device=DEV, seed=seed)
    return [inp[n].detach().clone().requires_grad_() for n in ("q", "gk", "k", "v", "a", "b")] + \
           [inp["initial_state"].detach().clone().requires_grad_()]


def _fwd_bwd(fn, leaves, **kw):
    o, ht = fn(*leaves, **kw)
    torch.autograd.backward((o, ht), (torch.ones_like(o), torch.ones_like(ht)))
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return [o.detach(), ht.detach(), *grads]


def _counting_backend():
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)
    return backend, frames


def test_fullgraph_equals_eager_and_new_lengths_compile_nothing():
    backend, frames = _counting_backend()
    compiled = torch.compile(_rwkv7, fullgraph=True, dynamic=True, backend=backend)
    with forbid_pytorch_stages():
        for T in (300, 517, 1000):
            leaves = _leaves(T)
            got = _fwd_bwd(compiled, leaves)
            want = _fwd_bwd(_rwkv7, leaves)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            if T == 300:
                first = len(frames)
    assert len(frames) == first, f"{len(frames) - first} graphs compiled for new lengths"


def test_new_varlen_layout_compiles_nothing():
    # N >= 2 in every layout: a size of 1 (N = 1) is specialised by Dynamo and costs one
    # recompile, as the README says for T <= chunk_size
    backend, frames = _counting_backend()
    compiled = torch.compile(_rwkv7, fullgraph=True, dynamic=True, backend=backend)
    with forbid_pytorch_stages():
        for cu in ([0, 5, 300, 600], [0, 1, 2, 64, 600], [0, 300, 600]):
            leaves = _leaves(600, B=1)
            leaves[-1] = leaves[-1].detach()[:1].expand(len(cu) - 1, -1, -1, -1).clone().requires_grad_()
            cu_t = torch.tensor(cu, device=DEV)
            got = _fwd_bwd(compiled, leaves, cu=cu_t)
            want = _fwd_bwd(_rwkv7, leaves, cu=cu_t)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            if len(cu) == 4:
                first = len(frames)
    assert len(frames) == first, f"{len(frames) - first} graphs compiled for new varlen layouts"


@pytest.mark.parametrize("policy", sorted(policies.POLICIES))
def test_checkpoint_policies_match_no_checkpoint(policy):
    from torch.utils.checkpoint import checkpoint
    ctx = policies.context_fn(policy)

    def ckpt(*args):
        return checkpoint(_rwkv7, *args, use_reentrant=False, context_fn=ctx)
    compiled = torch.compile(ckpt, fullgraph=True)
    with forbid_pytorch_stages():
        leaves = _leaves(700)
        want = _fwd_bwd(_rwkv7, leaves)
        for fn in (ckpt, compiled):
            for g, w in zip(_fwd_bwd(fn, leaves), want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_cuda_graphs_reduce_overhead():
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(_rwkv7, mode="reduce-overhead", fullgraph=True)
    with forbid_pytorch_stages():
        leaves = _leaves(512)
        for _ in range(3):  # warm-up, record, replay; before any eager call, so nothing the
            got = _fwd_bwd(compiled, leaves)  # ops build is made outside the graph pool first
        want = _fwd_bwd(_rwkv7, leaves)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    # the graphs were really captured (a skipped capture still gives right answers)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_rect_tables_are_one_async_copy_and_closed_form_under_capture(monkeypatch):
    """On CUDA a rect call's tables are copied from a pinned host copy without a host sync; a
    CUDA graph captures the closed form on the device instead, so its replays read no host
    buffer (dropping every host copy leaves them right)."""
    from torch_dplr.ops import varlen as varlen_mod

    empty = torch.empty(0, dtype=torch.int64, device=DEV)
    want = varlen_mod.packed_tables(empty.cpu(), 3, 200, 32, "cpu")
    torch.ops.dplr.chunk_tables(empty, 3, 200, 32)  # the host copy of this shape exists now
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = torch.ops.dplr.chunk_tables(empty, 3, 200, 32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), want)

    host_copies = []
    real = varlen_mod._rect_packed_on_host
    monkeypatch.setattr(varlen_mod, "_rect_packed_on_host",
                        lambda *a: host_copies.append(a) or real(*a))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            captured = torch.ops.dplr.chunk_tables(empty, 3, 200, 32)
    torch.cuda.current_stream().wait_stream(stream)
    assert host_copies == []
    real.cache_clear()
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.cpu(), want)


@pytest.mark.parametrize("varlen", [False, True])
def test_a_call_builds_its_chunk_tables_once(monkeypatch, varlen):
    """Forward+backward builds the kernels' chunk tables once (dplr::chunk_tables in the public
    function) and every stage op, forward and backward, reads them: the ops never build their
    own (8-15 small launches each, host time small grids do not hide)."""
    from torch_dplr.ops import varlen as varlen_mod

    inp = make_inputs(1 if varlen else 2, 256, 4, 64, dtype=torch.bfloat16, device=DEV,
                      num_states=3 if varlen else None)
    cu = torch.tensor([0, 5, 100, 256], device=DEV) if varlen else None
    _call(inp, 64, RWKV7_BOUND, cu)  # kernels loaded, tables built the ordinary way
    built = []
    real = varlen_mod.packed_tables
    monkeypatch.setattr(varlen_mod, "packed_tables", lambda *a: built.append(a) or real(*a))
    o, ht, grads = _call(inp, 64, RWKV7_BOUND, cu)
    assert len(built) == 1
    torch.cuda.synchronize()
    assert torch.isfinite(o.float()).all() and all(torch.isfinite(g.float()).all() for g in grads.values())
