"""torch.compile(fullgraph=True) of the public functions and of an RWKV-7 block.

Each test checks three things: one graph and no break, the captured graphs hold the ``dplr::``
forward ops (and the backward graph the ``dplr::`` backward ops), and outputs and every
gradient equal eager.
"""
import pytest
import torch

import torch_dplr

from ._support import (CHUNK_BWD, CHUNK_FWD, CHUNK_NO_GRAD, DEVICE, HEAD_DIM, INDUCTOR_DTYPES,
                       INDUCTOR_TOL, N_HEADS, RECURRENT_BWD, RECURRENT_FWD, SPLIT_BWD, SPLIT_FWD,
                       assert_all_close, block_input, chunk_fn, differentiable, dtype_id,
                       index_tensor, make_block, make_inputs, on_device, recurrent_fn,
                       run_and_grad)

VARLEN = [0, 13, 20, 51]  # 3 sequences: one within a chunk, one crossing two chunk boundaries


def assert_one_graph(recorder):
    assert recorder.frames == 1, f"expected one Dynamo graph, got {recorder.frames}"


def assert_training_graphs(recorder, fwd_ops, bwd_ops, calls=1):
    """The Dynamo graph and the AOT forward hold each forward op ``calls`` times, the backward
    graph each backward op ``calls`` times and no forward op (nothing is recomputed)."""
    for which in ("dynamo", "forward"):
        assert recorder.counts(which) == {op: calls for op in fwd_ops}, which
    assert len(recorder.backward) == 1
    assert recorder.counts("backward") == {op: calls for op in bwd_ops}


@pytest.mark.parametrize("varlen", [False, True], ids=["rect", "varlen"])
@pytest.mark.parametrize("initial_state", [False, True], ids=["no_h0", "h0"])
@pytest.mark.parametrize("output_final_state", [False, True], ids=["no_ht", "ht"])
def test_chunk_dplr_fullgraph(recorder, varlen, initial_state, output_final_state):
    x = make_inputs(B=1 if varlen else 2, T=VARLEN[-1] if varlen else 37,
                    cu_seqlens=VARLEN if varlen else None, initial_state=initial_state)
    args = [x[n] for n in ("q", "k", "v", "a", "b", "gk")]
    kwargs = dict(initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
                  output_final_state=output_final_state)
    tensors = differentiable(x)
    compiled = torch.compile(chunk_fn, backend=recorder, fullgraph=True)

    out_c, grads_c = run_and_grad(compiled, tensors, *args, **kwargs)
    out_e, grads_e = run_and_grad(chunk_fn, tensors, *args, **kwargs)

    assert_one_graph(recorder)
    assert_training_graphs(recorder, CHUNK_FWD, CHUNK_BWD)
    assert len(out_c) == (2 if output_final_state else 1)
    assert_all_close(out_c, out_e)
    assert all(g is not None for g in grads_c)
    assert_all_close(grads_c, grads_e)


@pytest.mark.parametrize("varlen", [False, True], ids=["rect", "varlen"])
@pytest.mark.parametrize("through", ["both", "final_state", "output"])
def test_split_pass_fullgraph(recorder, split_pass, varlen, through):
    """The two-op training pass: one graph of ``chunk_fwd`` (and the tables), a backward graph
    of ``chunk_bwd`` alone, eager's outputs and gradients, also when only one output reaches
    the loss."""
    x = make_inputs(B=1 if varlen else 2, T=VARLEN[-1] if varlen else 45,
                    cu_seqlens=VARLEN if varlen else None, initial_state=True)
    args = [x[n] for n in ("q", "k", "v", "a", "b", "gk")]

    def fn(*args):
        o, ht = chunk_fn(*args, initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
        return {"both": (o, ht), "final_state": ht, "output": o}[through]

    tensors = differentiable(x)
    out_c, grads_c = run_and_grad(torch.compile(fn, backend=recorder, fullgraph=True), tensors,
                                  *args)
    out_e, grads_e = run_and_grad(fn, tensors, *args)
    assert_one_graph(recorder)
    assert_training_graphs(recorder, SPLIT_FWD, SPLIT_BWD)
    assert_all_close(out_c, out_e)
    assert_all_close(grads_c, grads_e)


@pytest.mark.parametrize("through", ["final_state", "output"])
def test_chunk_dplr_gradient_through_one_output(recorder, through):
    """Only one of (o, final_state) reaches the loss: the other's gradient is absent (None in
    eager, handled by the ops' zero fill) and the compiled backward must agree."""
    x = make_inputs(T=45, initial_state=True)
    args = [x[n] for n in ("q", "k", "v", "a", "b", "gk")]
    tensors = differentiable(x)

    def fn(*args):
        o, ht = chunk_fn(*args, initial_state=x["initial_state"])
        return ht if through == "final_state" else o

    compiled = torch.compile(fn, backend=recorder, fullgraph=True)
    out_c, grads_c = run_and_grad(compiled, tensors, *args)
    out_e, grads_e = run_and_grad(fn, tensors, *args)
    assert_one_graph(recorder)
    assert_training_graphs(recorder, CHUNK_FWD, CHUNK_BWD)
    assert_all_close(out_c, out_e)
    assert_all_close(grads_c, grads_e)


def test_chunk_dplr_explain_no_graph_break():
    """The same claim, through the user-facing diagnostic."""
    x = make_inputs(T=30, initial_state=True)
    args = [x[n] for n in ("q", "k", "v", "a", "b", "gk")]
    explanation = torch._dynamo.explain(chunk_fn)(*args, initial_state=x["initial_state"])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("varlen", [False, True], ids=["rect", "varlen"])
def test_fused_recurrent_fullgraph(recorder, varlen):
    x = make_inputs(B=1 if varlen else 2, T=VARLEN[-1] if varlen else 23,
                    cu_seqlens=VARLEN if varlen else None, initial_state=True)
    args = [x[n] for n in ("q", "k", "v", "a", "b", "gk")]
    kwargs = dict(initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    tensors = differentiable(x)
    compiled = torch.compile(recurrent_fn, backend=recorder, fullgraph=True)
    out_c, grads_c = run_and_grad(compiled, tensors, *args, **kwargs)
    out_e, grads_e = run_and_grad(recurrent_fn, tensors, *args, **kwargs)
    assert_one_graph(recorder)
    assert_training_graphs(recorder, RECURRENT_FWD, RECURRENT_BWD)
    assert_all_close(out_c, out_e)
    assert_all_close(grads_c, grads_e)


def test_chunk_rwkv7_matches_recurrent_rwkv7_under_compile(recorder):
    """The two RWKV-7 entry points agree when both are compiled into one graph."""
    x = make_inputs(T=33, initial_state=True, requires_grad=False)
    r, k, v, a, b = (x[n] for n in ("q", "k", "v", "a", "b"))
    w = -0.6 * torch.sigmoid(x["gk"])

    def both(r, w, k, v, a, b, h0):
        o1, h1 = torch_dplr.chunk_rwkv7(r, w, k, v, a, b, initial_state=h0,
                                        output_final_state=True, lower_bound=-0.6065)
        o2, h2 = torch_dplr.fused_recurrent_rwkv7(r, w, k, v, a, b, initial_state=h0)
        return o1, h1, o2, h2

    o1, h1, o2, h2 = torch.compile(both, backend=recorder, fullgraph=True)(
        r, w, k, v, a, b, x["initial_state"])
    assert_one_graph(recorder)
    # inputs without grad: the chunked call is the one no-grad op
    assert set(recorder.counts("dynamo")) == CHUNK_NO_GRAD | RECURRENT_FWD
    torch.testing.assert_close(o1, o2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h1, h2, rtol=1e-4, atol=1e-5)


def test_chunk_dplr_strided_inputs_fullgraph(recorder):
    """q, k, v as views of one fused projection (non-contiguous, the usual model code): the
    compiled op reads them with their strides, as eager does and as contiguous copies give."""
    g = torch.Generator().manual_seed(0)
    qkv = on_device(torch.randn(2, 40, 3, N_HEADS, HEAD_DIM, generator=g)).requires_grad_()
    gk = torch.nn.functional.logsigmoid(torch.randn(2, 40, N_HEADS, HEAD_DIM, generator=g))
    gk = on_device(gk).requires_grad_()

    def fn(qkv, gk, contiguous=False):
        q, k, v = (t.contiguous() if contiguous else t for t in qkv.unbind(2))
        assert contiguous or not q.is_contiguous()
        kk = torch.nn.functional.normalize(k, dim=-1)
        return chunk_fn(q, k, v, -kk, kk * 0.5, gk)

    compiled = torch.compile(fn, backend=recorder, fullgraph=True)
    out_c, grads_c = run_and_grad(compiled, [qkv, gk], qkv, gk)
    out_e, grads_e = run_and_grad(fn, [qkv, gk], qkv, gk)
    out_ref, grads_ref = run_and_grad(fn, [qkv, gk], qkv, gk, contiguous=True)
    assert_one_graph(recorder)
    assert_all_close(out_c, out_e)
    assert_all_close(grads_c, grads_e)
    assert_all_close(out_e, out_ref)
    assert_all_close(grads_e, grads_ref)


# ---------------------------------------------------------------------------------------------
# RWKV-7 time-mix block
# ---------------------------------------------------------------------------------------------

def block_grads(block, x, compiled, *args):
    tensors = [x, *block.parameters()]
    return run_and_grad(compiled, tensors, x, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rwkv7_block_fullgraph(recorder, dtype):
    block, x = make_block(dtype=dtype), block_input(T=53, dtype=dtype)
    compiled = torch.compile(block, backend=recorder, fullgraph=True)
    out_c, grads_c = block_grads(block, x, compiled)
    out_e, grads_e = block_grads(block, x, block)
    assert_one_graph(recorder)
    assert_training_graphs(recorder, CHUNK_FWD, CHUNK_BWD)
    assert_all_close(out_c, out_e)
    assert all(g is not None and g.abs().sum() > 0 for g in grads_c)
    assert_all_close(grads_c, grads_e)


def test_rwkv7_block_with_state_varlen_fullgraph(recorder):
    """State passing and packed sequences through the block (all gradients incl. the state)."""
    block, x = make_block(), block_input(B=1, T=VARLEN[-1])
    # drawn from the global generator, which make_block has just seeded
    state = on_device(torch.randn(len(VARLEN) - 1, N_HEADS, HEAD_DIM, HEAD_DIM)).requires_grad_()
    cu = index_tensor(VARLEN)
    compiled = torch.compile(block, backend=recorder, fullgraph=True)
    tensors = [x, state, *block.parameters()]
    out_c, grads_c = run_and_grad(compiled, tensors, x, state, cu)
    out_e, grads_e = run_and_grad(block, tensors, x, state, cu)
    assert_one_graph(recorder)
    assert_training_graphs(recorder, CHUNK_FWD, CHUNK_BWD)
    assert len(out_c) == 2
    assert_all_close(out_c, out_e)
    assert_all_close(grads_c, grads_e)


def test_rwkv7_block_explain_no_graph_break():
    block, x = make_block(), block_input(T=30)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("dtype", INDUCTOR_DTYPES, ids=dtype_id)
def test_rwkv7_block_inductor(inductor_recorder, dtype):
    """What users run: the default Inductor backend.  The dplr ops stay opaque nodes in the
    graphs Inductor compiles (it neither decomposes nor drops them) and results match eager.
    (bf16 on CUDA only: at a kernel head size it runs the TileLang kernels.)"""
    block, x = make_block(dtype=dtype), block_input(T=40, dtype=dtype)
    compiled = torch.compile(block, backend=inductor_recorder, fullgraph=True)
    out_c, grads_c = block_grads(block, x, compiled)
    out_e, grads_e = block_grads(block, x, block)
    assert_one_graph(inductor_recorder)
    assert_training_graphs(inductor_recorder, CHUNK_FWD, CHUNK_BWD)
    assert_all_close(out_c, out_e, INDUCTOR_TOL)
    assert_all_close(grads_c, grads_e, INDUCTOR_TOL)


# ---------------------------------------------------------------------------------------------
# Autocast (mixed-precision training)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_chunk_rwkv7_under_autocast(recorder, compiled):
    """fp32 inputs under bf16 ``torch.autocast``: like scaled_dot_product_attention, the op
    runs in the autocast dtype (r, k, v, a, b cast to bf16; the gate and the state keep fp32),
    so the result equals the call on bf16-cast inputs without autocast."""
    x = make_inputs(T=40, initial_state=True, requires_grad=False)
    r, k, v, a, b = (x[n] for n in ("q", "k", "v", "a", "b"))
    w = -0.6 * torch.sigmoid(x["gk"])

    def fn(*args):
        return torch_dplr.chunk_rwkv7(*args, initial_state=x["initial_state"],
                                      output_final_state=True, lower_bound=-0.6065)

    b16 = b.to(torch.float16)  # mixed input dtypes meet in the autocast dtype
    bf16 = lambda t: t.to(torch.bfloat16)  # noqa: E731
    expected = fn(bf16(r), w, bf16(k), bf16(v), bf16(a), bf16(b16))
    run = torch.compile(fn, backend=recorder, fullgraph=True) if compiled else fn
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        actual = run(r, w, k, v, a, b16)
    assert [t.dtype for t in actual] == [torch.bfloat16, torch.float32]
    assert_all_close(actual, expected)


def test_rwkv7_block_under_autocast_compiled(recorder):
    """A bf16-autocast training step through the compiled block: one graph with the dplr ops,
    gradients for every parameter, and results near the fp32 block (bf16 projections)."""
    block, x = make_block(), block_input(T=40)
    compiled = torch.compile(block, backend=recorder, fullgraph=True)
    tensors = [x, *block.parameters()]
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        (out,), grads = run_and_grad(compiled, tensors, x)
    (ref,), grads_ref = run_and_grad(block, tensors, x)
    assert_one_graph(recorder)
    assert_training_graphs(recorder, CHUNK_FWD, CHUNK_BWD)
    assert out.dtype == torch.bfloat16
    rel = lambda x, y: ((x.float() - y).norm() / y.norm()).item()  # noqa: E731
    assert rel(out, ref) < 1.5e-2
    for g, g_ref in zip(grads, grads_ref):
        assert rel(g, g_ref) < 2e-2
