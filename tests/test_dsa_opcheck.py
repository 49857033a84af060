"""torch.library.opcheck on every dsa op (schema, autograd registration, fakes, AOT dispatch),
several samples each: packed sequences with an empty and a 1-token one and a padding tail,
topk larger than T, head counts that are not powers of two, fp32 / fp64 / bf16, with and
without requires_grad; plus gradcheck of each differentiable op in fp64."""
import pytest
import torch

import torch_dplr  # noqa: F401
from torch_dplr.dsa import ops
from torch_dplr.dsa.testing import make_inputs

dsa = torch.ops.dsa
CONFIGS = [  # (T, H, D_qk, d_v, H_idx, D_idx, topk, cu_seqlens, dtype)
    (20, 3, 24, 16, 2, 16, 5, [0, 7, 7, 8, 18], torch.float32),
    (13, 1, 8, 8, 1, 4, 32, None, torch.float64),
    (17, 5, 12, 5, 3, 8, 4, [0, 17], torch.bfloat16),
]


def _cu(cu):
    return torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu, dtype=torch.int32)


def _forward_results(config):
    T, H, D, d_v, H_idx, D_idx, topk, cu, dtype = config
    x = make_inputs(T, H, D, H_idx, D_idx, dtype=dtype)
    cu_t = _cu(cu)
    indices = dsa.indexer_topk(x["q_idx"], x["k_idx"], x["w"], cu_t, topk)
    o, lse = dsa.sparse_mla_fwd(x["q"], x["kv"], indices, D ** -0.5, d_v)
    scores = dsa.indexer_fwd(x["q_idx"], x["k_idx"], x["w"], indices)
    return x, cu_t, indices, o, lse, scores


def forward_samples():
    for config in CONFIGS:
        T, H, D, d_v, H_idx, D_idx, topk, cu, dtype = config
        x, cu_t, indices, o, lse, scores = _forward_results(config)
        for grad in (False, True):
            g = lambda t: t.detach().clone().requires_grad_(grad)  # noqa: E731
            yield "indexer_topk", (g(x["q_idx"]), g(x["k_idx"]), g(x["w"]), cu_t, topk)
            yield "indexer_fwd", (g(x["q_idx"]), g(x["k_idx"]), g(x["w"]), indices)
            yield "sparse_mla_fwd", (g(x["q"]), g(x["kv"]), indices, D ** -0.5, d_v)
            for reduction in ("mean", "sum"):
                yield "indexer_loss_fwd", (g(scores), g(x["q"]), g(x["kv"]), indices, g(lse),
                                           D ** -0.5, 0.3, reduction)


def backward_samples():
    gen = torch.Generator().manual_seed(1)
    rand = lambda t: torch.randn(t.shape, generator=gen).to(t.dtype)  # noqa: E731
    for config in CONFIGS:
        T, H, D, d_v, H_idx, D_idx, topk, cu, dtype = config
        x, cu_t, indices, o, lse, scores = _forward_results(config)
        yield "indexer_bwd", (x["q_idx"], x["k_idx"], x["w"], indices, rand(scores))
        yield "sparse_mla_bwd", (x["q"], x["kv"], indices, o, lse, rand(o), torch.zeros_like(lse),
                                 D ** -0.5, d_v)
        yield "sparse_mla_bwd", (x["q"], x["kv"], indices, o, lse, rand(o), rand(lse),
                                 D ** -0.5, d_v)
        _, target = dsa.indexer_loss_fwd(scores, x["q"], x["kv"], indices, lse, D ** -0.5, 0.3,
                                         "mean")
        for reduction in ("mean", "sum"):
            yield "indexer_loss_bwd", (scores, target, indices, torch.tensor(1.7), 0.3, reduction)


FWD = list(forward_samples())
BWD = list(backward_samples())


def _ids(samples):
    return [f"{name}-{i}" for i, (name, _) in enumerate(samples)]


def test_every_dsa_op_has_samples():
    assert {name for name, _ in FWD + BWD} == set(ops.FORWARD_OPS) | set(ops.BACKWARD_OPS)
    registered = {name.split("::")[1] for name in torch._library.custom_ops.OPDEFS
                  if name.startswith("dsa::")}
    assert registered == set(ops.FORWARD_OPS) | set(ops.BACKWARD_OPS)


@pytest.mark.parametrize("name,args", FWD, ids=_ids(FWD))
def test_forward_op(name, args):
    torch.library.opcheck(getattr(dsa, name).default, args)


@pytest.mark.parametrize("name,args", BWD, ids=_ids(BWD))
def test_backward_op(name, args):
    torch.library.opcheck(getattr(dsa, name).default, args)


def test_topk_output_carries_no_gradient():
    x, cu_t, *_ = _forward_results(CONFIGS[0])
    q_idx = x["q_idx"].requires_grad_()
    indices = dsa.indexer_topk(q_idx, x["k_idx"], x["w"], cu_t, 5)
    assert indices.dtype == torch.int32 and not indices.requires_grad


def _fp64_case():
    x, cu_t, indices, o, lse, scores = _forward_results(
        (9, 2, 6, 4, 2, 3, 4, [0, 2, 2, 9], torch.float64))
    return {n: t.detach().clone().requires_grad_() for n, t in x.items()}, indices, lse


def test_gradcheck_indexer_scores():
    x, indices, _ = _fp64_case()
    fn = lambda qi, ki, w: torch.where(indices >= 0, dsa.indexer_fwd(qi, ki, w, indices), 0)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x["q_idx"], x["k_idx"], x["w"]))


def test_gradcheck_sparse_mla():
    x, indices, _ = _fp64_case()

    def fn(q, kv):
        o, lse = dsa.sparse_mla_fwd(q, kv, indices, 0.4, 4)
        return o, lse

    assert torch.autograd.gradcheck(fn, (x["q"], x["kv"]))


def test_gradcheck_indexer_loss():
    x, indices, lse = _fp64_case()
    scores = dsa.indexer_fwd(x["q_idx"], x["k_idx"], x["w"], indices).detach()
    finite = torch.where(indices >= 0, scores, 0).requires_grad_()
    for reduction in ("mean", "sum"):
        fn = lambda s: dsa.indexer_loss_fwd(s, x["q"].detach(), x["kv"].detach(), indices,  # noqa: E731
                                            lse.detach(), 0.4, 0.6, reduction)[0]
        assert torch.autograd.gradcheck(fn, (finite,))
