"""Edge cases of the DSA functions: no tokens, rows that see no key (padding tokens, a row of
-1 indices), 1-token sequences, topk beyond the visible keys, output dtypes per input dtype."""
import pytest
import torch

import torch_dplr
from torch_dplr.dsa.testing import make_inputs

dsa = torch_dplr.dsa
ARGS = ("q", "kv", "q_idx", "k_idx", "w")


def run(x, **kwargs):
    kwargs = dict(topk=4, scale=0.3, d_v=16, indexer_loss_coeff=0.5) | kwargs
    return dsa.dsa_attention(*(x[n] for n in ARGS), **kwargs)


def leaves(T, dtype=torch.float32, **kwargs):
    return {n: t.requires_grad_() for n, t in make_inputs(T, dtype=dtype, **kwargs).items()}


def test_no_tokens():
    x = leaves(0)
    out = run(x)
    assert out.o.shape == (0, 3, 16) and out.lse.shape == (0, 3) and out.indices.shape == (0, 4)
    assert out.indexer_loss.item() == 0.0
    (out.o.sum() + out.indexer_loss).backward()
    assert all(x[n].grad is not None and x[n].grad.shape == x[n].shape for n in ARGS)


def test_padding_tokens_see_nothing():
    """Tokens past cu_seqlens[-1]: indices all -1, o = 0, lse = -inf, no gradient, no NaN, not
    counted by the loss's mean."""
    x = leaves(12)
    out = run(x, cu_seqlens=torch.tensor([0, 5, 8]))
    pad = slice(8, 12)
    assert (out.indices[pad] == -1).all()
    assert (out.o[pad] == 0).all() and torch.isneginf(out.lse[pad]).all()
    assert torch.isfinite(out.o).all() and torch.isfinite(out.lse[:8]).all()
    g = torch.randn(out.o.shape)
    (out.o * g).sum().backward(retain_graph=True)
    assert (x["q"].grad[pad] == 0).all() and (x["kv"].grad[pad] == 0).all()
    assert all(torch.isfinite(x[n].grad).all() for n in ("q", "kv"))
    # the loss over the 8 real tokens is the loss of the same call without the padding
    x8 = {n: t[:8].detach() for n, t in x.items()}
    assert torch.allclose(out.indexer_loss, run(x8, cu_seqlens=torch.tensor([0, 5, 8])).indexer_loss)


def test_every_token_padding():
    x = leaves(6)
    out = run(x, cu_seqlens=torch.tensor([0, 0]))
    assert (out.indices == -1).all() and (out.o == 0).all() and torch.isneginf(out.lse).all()
    assert out.indexer_loss.item() == 0.0
    (out.o.sum() + out.indexer_loss).backward()
    assert all((x[n].grad == 0).all() for n in ARGS)


def test_a_row_of_minus_ones_in_sparse_mla():
    x = make_inputs(6, dtype=torch.float64)
    q, kv = x["q"].requires_grad_(), x["kv"].requires_grad_()
    indices = torch.tensor([[0, -1], [-1, -1], [1, 2], [-1, 3], [4, -1], [5, 2]], dtype=torch.int32)
    o, lse = dsa.sparse_mla(q, kv, indices, scale=0.3, d_v=16)
    assert (o[1] == 0).all() and torch.isneginf(lse[1]).all() and torch.isfinite(lse[[0, 2, 3, 4, 5]]).all()
    (o.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert (q.grad[1] == 0).all() and torch.isfinite(kv.grad).all()


def test_sparse_mla_without_slots():
    """indices [T, 0]: every row is empty (o = 0, lse = -inf), and the gradients are zeros."""
    x = make_inputs(5)
    q, kv = x["q"].requires_grad_(), x["kv"].requires_grad_()
    o, lse = dsa.sparse_mla(q, kv, torch.empty(5, 0, dtype=torch.int32), scale=0.3, d_v=16)
    assert (o == 0).all() and torch.isneginf(lse).all()
    o.sum().backward()
    assert (q.grad == 0).all() and (kv.grad == 0).all()


def test_indexer_loss_without_slots():
    """scores and indices [T, 0]: no row has a valid slot, so the loss is 0 (either reduction)
    and the scores' gradient is empty."""
    x = make_inputs(5)
    scores = torch.empty(5, 0, requires_grad=True)
    lse = torch.full((5, x["q"].shape[1]), float("-inf"))
    for reduction in ("mean", "sum"):
        loss, target = torch.ops.dsa.indexer_loss_fwd(scores, x["q"], x["kv"],
                                                       torch.empty(5, 0, dtype=torch.int32),
                                                       lse, 0.3, 0.5, reduction)
        assert loss.item() == 0 and target.shape == (5, 0)
        (dscores,) = torch.autograd.grad(loss, scores)
        assert dscores.shape == (5, 0)


def test_one_token_sequences():
    """Every token alone: each attends to itself (o = its value row, lse = its own logit), and
    the loss is 0 (one selected key: both distributions are 1)."""
    T = 7
    x = make_inputs(T, dtype=torch.float64)
    out = run(x, cu_seqlens=torch.arange(T + 1), topk=3)
    assert torch.equal(out.indices[:, 0], torch.arange(T, dtype=torch.int32))
    assert (out.indices[:, 1:] == -1).all()
    torch.testing.assert_close(out.o, x["kv"][:, None, :16].expand(T, 3, 16))
    torch.testing.assert_close(out.lse, 0.3 * torch.einsum("thd,td->th", x["q"], x["kv"]))
    assert abs(out.indexer_loss.item()) < 1e-15


def test_topk_larger_than_every_sequence_is_dense_attention():
    """topk >= the longest sequence selects every visible key: o is causal softmax attention."""
    T = 9
    x = make_inputs(T, dtype=torch.float64)
    out = run(x, topk=50, cu_seqlens=torch.tensor([0, 4, 9]))
    assert ((out.indices >= 0).sum(1) == torch.tensor([1, 2, 3, 4, 1, 2, 3, 4, 5])).all()
    mask = torch.zeros(T, T, dtype=torch.bool)
    for s, e in ((0, 4), (4, 9)):
        mask[s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
    logits = 0.3 * torch.einsum("thd,sd->hts", x["q"], x["kv"])
    probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(out.o, torch.einsum("hts,sd->thd", probs, x["kv"][:, :16]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_output_and_gradient_dtypes(dtype):
    x = leaves(10, dtype)
    out = run(x, cu_seqlens=torch.tensor([0, 3, 10]))
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.o.dtype == dtype and out.lse.dtype == wide and out.indexer_loss.dtype == wide
    assert out.indices.dtype == torch.int32
    (out.o.float().sum() + out.indexer_loss).backward()
    assert all(x[n].grad.dtype == dtype for n in ARGS)


def test_w_may_have_its_own_dtype():
    x = make_inputs(10, dtype=torch.bfloat16)
    x["w"] = x["w"].float().requires_grad_()
    out = run(x)
    out.indexer_loss.backward()
    assert x["w"].grad.dtype == torch.float32


def test_no_loss_without_a_coefficient():
    x = leaves(10)
    out = run(x, indexer_loss_coeff=0.0)
    assert out.indexer_loss is None
    out.o.sum().backward()
    assert x["q_idx"].grad is None  # the selection carries no gradient


def test_autocast_runs_in_the_autocast_dtype():
    x = make_inputs(10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(x)
    assert out.o.dtype == torch.bfloat16 and out.lse.dtype == torch.float32


def test_indexer_scaling_is_left_to_w():
    """The op applies no scaling: scaling w scales the scores (ReLU is positively homogeneous)
    and leaves the selection unchanged."""
    x = make_inputs(15, dtype=torch.float64, index_scale=False)
    i1, s1 = dsa.indexer_topk(x["q_idx"], x["k_idx"], x["w"], 5)
    i2, s2 = dsa.indexer_topk(x["q_idx"], x["k_idx"], x["w"] * 0.125, 5)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(s2[i2 >= 0], 0.125 * s1[i1 >= 0])
