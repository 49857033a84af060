"""Compiled forward without autograd (evaluation, generation) and CUDA-graph mode."""
import pytest
import torch

from ._support import (ARG_NAMES, CHUNK_BWD, CHUNK_FWD, CHUNK_NO_GRAD, INDUCTOR_DTYPES,
                       INDUCTOR_TOL, assert_all_close, block_input, chunk_fn, dplr, dtype_id,
                       find_nodes, make_block, make_inputs, runs_tilelang_kernels)

GRAD_FREE = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("mode", GRAD_FREE)
@pytest.mark.parametrize("varlen", [False, True], ids=["rect", "varlen"])
def test_chunk_dplr_grad_free_forward(recorder, mode, varlen):
    """Inputs that require grad, called under no_grad / inference_mode: one inference graph,
    no backward, results equal eager, and the whole forward is exactly one
    ``dplr::chunk_fwd_fused`` node (nothing kept for a backward), with eager's output dtypes
    and shapes."""
    cu = [0, 21, 50] if varlen else None
    x = make_inputs(B=1 if varlen else 2, T=50, cu_seqlens=cu, initial_state=True)
    args = [x[n] for n in ARG_NAMES]
    kwargs = dict(initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    compiled = torch.compile(chunk_fn, backend=recorder, fullgraph=True)
    with GRAD_FREE[mode]():
        out_c = compiled(*args, **kwargs)
        out_e = chunk_fn(*args, **kwargs)
    assert recorder.frames == 1
    assert not recorder.forward and not recorder.backward and len(recorder.inference) == 1
    assert recorder.counts("inference") == {op: 1 for op in CHUNK_NO_GRAD}
    assert not out_c[0].requires_grad
    assert_all_close(out_c, out_e)
    (fused,) = find_nodes(recorder.inference, dplr.chunk_fwd_fused.default)
    o, ht = fused.meta["val"]
    assert (o.shape, o.dtype) == (out_e[0].shape, out_e[0].dtype)
    assert (ht.shape, ht.dtype) == (out_e[1].shape, out_e[1].dtype)


def test_inputs_without_grad_take_the_fused_op(recorder):
    """Grad mode on but no input requiring grad: also one ``dplr::chunk_fwd_fused`` node,
    fullgraph, equal to eager."""
    x = make_inputs(B=2, T=50, initial_state=True)
    args = [x[n].detach() for n in ARG_NAMES]
    kwargs = dict(initial_state=x["initial_state"].detach())
    compiled = torch.compile(chunk_fn, backend=recorder, fullgraph=True)
    out_c, out_e = compiled(*args, **kwargs), chunk_fn(*args, **kwargs)
    assert recorder.frames == 1 and not recorder.backward
    assert recorder.counts("dynamo") == {op: 1 for op in CHUNK_NO_GRAD}
    assert_all_close(out_c, out_e)


def test_rwkv7_block_eval_then_train(recorder):
    """Evaluation then training through one compiled module: a grad-mode guard gives the
    training call its own graph, each correct."""
    block, x = make_block(), block_input(T=44, requires_grad=False)
    compiled = torch.compile(block, backend=recorder, fullgraph=True)
    with torch.no_grad():
        y_eval = compiled(x)
        y_ref = block(x)
    torch.testing.assert_close(y_eval, y_ref, rtol=1e-5, atol=1e-6)
    y_train = compiled(x)
    assert y_train.requires_grad
    torch.testing.assert_close(y_train.detach(), y_ref, rtol=1e-5, atol=1e-6)
    assert recorder.frames == 2
    assert recorder.counts("inference") == {op: 1 for op in CHUNK_NO_GRAD}
    assert recorder.counts("forward") == {op: 1 for op in CHUNK_FWD}
    y_train.sum().backward()
    assert set(recorder.counts("backward")) == CHUNK_BWD


# Inductor's bf16 tolerance; fp32 as tight as this test always held it
CUDA_GRAPH_TOL = {**INDUCTOR_TOL, torch.float32: (1e-4, 1e-5)}


def reduce_overhead_case(dtype):
    """The CUDA-graph test at ``dtype``: run where every op runs its TileLang kernel (no host
    sync, no tensor kept across calls); skipped on the PyTorch kernels, whose capture fails.
    Not an xfail: a capture that raises can leave the CUDA generator marked as capturing, and a
    later ``torch.randn`` on CUDA in the same process (Inductor's pad_mm benchmarking, say)
    then raises "Offset increment outside graph capture"."""
    if runs_tilelang_kernels(dtype):
        return pytest.param(dtype, id=dtype_id(dtype))
    reason = ("the PyTorch kernels on CUDA sync the host and cache layouts built during capture; "
              "graph capture needs every op on its TileLang kernel (bf16 at "
              "TORCH_DPLR_TEST_HEAD_DIM=64/128)")
    return pytest.param(dtype, marks=pytest.mark.skip(reason=reason), id=dtype_id(dtype))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason='mode="reduce-overhead" (CUDA graphs) needs a CUDA GPU')
@pytest.mark.parametrize("dtype", [reduce_overhead_case(d) for d in INDUCTOR_DTYPES])
def test_rwkv7_block_reduce_overhead_cuda(dtype):
    """CUDA graphs capture the whole step: no host sync or data-dependent Python in the ops
    (a skipped capture would leave the dplr ops' launch overhead in place).  Runs on CUDA
    whatever TORCH_DPLR_TEST_DEVICE says (``.cuda()`` is a no-op when already there)."""
    from torch._dynamo.utils import counters

    counters.clear()
    block = make_block(dtype=dtype).cuda()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for step in range(3):  # warm-up, record, replay
        # One training step per iteration. The parameter gradients of a replayed backward live
        # in the graph's memory pool, so they are dropped before the next replay overwrites them
        # (as an optimizer's zero_grad(set_to_none=True) does); accumulating into them fails.
        block.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        x = block_input(T=64, seed=step, dtype=dtype).cuda()
        y = compiled(x)
        y_ref = block(x)
        assert_all_close([y], [y_ref], CUDA_GRAPH_TOL)
        y.sum().backward()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
