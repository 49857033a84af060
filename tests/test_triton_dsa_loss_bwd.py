"""The Triton kernel of the KL loss's backward (``csrc_triton/dsa_loss_bwd.py``) and
``dsa::indexer_loss_bwd``'s CUDA function.

* Without a GPU (Triton's interpreter, ``TRITON_INTERPRET=1``, conftest.py): the CUDA function
  on CPU tensors against the op's PyTorch kernel (rows longer than one block, -1 tails, rows
  without a slot, fp32 / bf16 / fp16 scores, both reductions), non-finite scores, which calls
  keep the PyTorch kernel.
* GPU (marker ``cuda``): the kernel at the benchmark's size against the PyTorch kernel, the
  backward of the op through autograd with every PyTorch kernel forbidden, a CUDA graph replay.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton import dsa_loss_bwd  # noqa: E402
from torch_dplr.dsa.ops import loss as op  # noqa: E402
from torch_dplr.dsa.testing import forbid_pytorch_kernels  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter is on only without a GPU (conftest.py); the cuda tests below run "
           "the kernel on the GPU")


def make_inputs(T, k, scores_dtype=torch.float32, seed=0, device="cpu"):
    """scores, target, indices, dloss: rows with -1 tails of random length, every fifth row
    without a slot, the target a distribution over each row's valid slots."""
    gen = torch.Generator(device=device).manual_seed(seed)
    indices = torch.randint(0, 4 * k + 1, (T, k), generator=gen, device=device,
                            dtype=torch.int32)
    lengths = torch.randint(0, k + 1, (T, 1), generator=gen, device=device)
    lengths[::5] = 0
    valid = torch.arange(k, device=device)[None, :] < lengths
    indices = torch.where(valid, indices, -1)
    scores = (torch.randn(T, k, generator=gen, device=device) * 3).to(scores_dtype)
    raw = torch.rand(T, k, generator=gen, device=device) * valid
    target = raw / raw.sum(dim=1, keepdim=True).clamp(min=1e-30)
    dloss = torch.rand((), generator=gen, device=device) + 0.5
    return scores, target, indices, dloss


def tolerance(scores_dtype):
    # the gradient is written in the scores' dtype
    return dict(rtol=1e-5, atol=1e-7) if scores_dtype == torch.float32 else \
        dict(rtol=1e-2, atol=1e-5)


@interpreted
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("scores_dtype", [torch.float32, BF16, FP16], ids=str)
@pytest.mark.parametrize("T,k", [(7, 5), (40, 200), (6, 2500)])
def test_cuda_body_matches_the_pytorch_kernel(T, k, scores_dtype, reduction):
    """k = 2500 takes three blocks of 1024 slots per pass, the last partial."""
    scores, target, indices, dloss = make_inputs(T, k, scores_dtype)
    got = op.indexer_loss_bwd_cuda(scores, target, indices, dloss, 0.3, reduction)
    want = op.indexer_loss_bwd_reference(scores, target, indices, dloss, 0.3, reduction)
    assert got.dtype == scores_dtype and got.shape == scores.shape
    torch.testing.assert_close(got, want, **tolerance(scores_dtype))
    assert (got[indices < 0] == 0).all()


@interpreted
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy on inf - inf
def test_non_finite_scores_follow_the_pytorch_kernel():
    """-inf on a valid slot: softmax 0 there; a row of -inf scores: ``-factor · p``; +inf:
    NaN there, softmax 0 on the row's other slots; NaN: that row NaN; the other rows
    untouched."""
    scores, target, indices, dloss = make_inputs(12, 40, seed=3)
    indices[1:5, :10] = torch.arange(10, dtype=torch.int32)  # rows 1-4 have ten valid slots
    scores[1, 3] = float("-inf")
    scores[2, :] = float("-inf")
    scores[3, 7] = float("inf")
    scores[4, 2] = float("nan")
    got = op.indexer_loss_bwd_cuda(scores, target, indices, dloss, 1.0, "sum")
    want = op.indexer_loss_bwd_reference(scores, target, indices, dloss, 1.0, "sum")
    assert torch.isfinite(got[[0, 1, 2, *range(5, 12)]]).all()
    assert got[4, :10].isnan().all() and got[3].isnan().sum() == 1 and got[3, 7].isnan()
    torch.testing.assert_close(got[3, :7], -dloss * target[3, :7], rtol=1e-6, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, equal_nan=True)
    torch.testing.assert_close(got[2, :10], -dloss * target[2, :10], rtol=1e-6, atol=0)


@interpreted
def test_empty_calls():
    for T, k in ((0, 8), (5, 0)):
        scores, target, indices, dloss = make_inputs(T, k)
        got = op.indexer_loss_bwd_cuda(scores, target, indices, dloss, 1.0, "mean")
        assert got.shape == (T, k)


@interpreted
@pytest.mark.parametrize("change", ["switched_off", "fp64 scores", "int64 indices",
                                    "bf16 target"])
def test_cuda_body_keeps_the_pytorch_kernel(change, monkeypatch):
    scores, target, indices, dloss = make_inputs(9, 30)
    if change == "switched_off":
        monkeypatch.setenv(op.LOSS_KERNEL_SWITCH, "0")
    elif change == "fp64 scores":
        scores, target, dloss = scores.double(), target.double(), dloss.double()
    elif change == "int64 indices":
        indices = indices.long()
    else:
        target = target.to(BF16)
    launched = []
    monkeypatch.setattr(dsa_loss_bwd, "launch", lambda *args: launched.append(args))
    got = op.indexer_loss_bwd_cuda(scores, target, indices, dloss, 0.5, "mean")
    want = op.indexer_loss_bwd_reference(scores, target, indices, dloss, 0.5, "mean")
    assert torch.equal(got, want) and launched == []


def test_cuda_body_checks_the_reduction_first():
    scores, target, indices, dloss = make_inputs(3, 4)
    with pytest.raises(ValueError, match="reduction"):
        op.indexer_loss_bwd_cuda(scores, target, indices, dloss, 1.0, "max")


def test_block_sizes():
    assert [dsa_loss_bwd.block_for(k) for k in (1, 17, 200, 1024, 2048, 5000)] == \
        [16, 32, 256, 1024, 1024, 1024]


# ---- GPU ----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("scores_dtype", [torch.float32, BF16], ids=str)
def test_kernel_at_the_benchmark_size(scores_dtype, reduction):
    """T 8192, k 2048 (two blocks per pass), through the op with the PyTorch kernels
    forbidden; two runs give the same bits (no atomics)."""
    scores, target, indices, dloss = make_inputs(8192, 2048, scores_dtype, device="cuda")
    with forbid_pytorch_kernels():
        got = torch.ops.dsa.indexer_loss_bwd(scores, target, indices, dloss, 0.01, reduction)
        again = torch.ops.dsa.indexer_loss_bwd(scores, target, indices, dloss, 0.01, reduction)
    want = op.indexer_loss_bwd_reference(scores, target, indices, dloss, 0.01, reduction)
    torch.testing.assert_close(got, want, **tolerance(scores_dtype))
    assert torch.equal(got, again)


@pytest.mark.cuda
def test_graph_replay():
    scores, target, indices, dloss = make_inputs(300, 700, BF16, device="cuda")
    args = (scores, target, indices, dloss, 0.1, "mean")
    want = op.indexer_loss_bwd_reference(*args)
    torch.ops.dsa.indexer_loss_bwd(*args)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = torch.ops.dsa.indexer_loss_bwd(*args)
    got.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, **tolerance(BF16))
