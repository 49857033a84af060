"""Bad input to the public DSA functions: a ValueError / TypeError naming the argument, raised
before any dsa op runs; and the op bodies' own checks (what torch.compile cannot check at
trace time)."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_dplr
from torch_dplr.dsa.testing import make_inputs

dsa = torch_dplr.dsa
T = 10


class DsaOpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dsa":
            self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def base():
    x = make_inputs(T)
    return dict(args=[x[n] for n in ("q", "kv", "q_idx", "k_idx", "w")],
                kwargs=dict(topk=4, scale=0.3, d_v=16, indexer_loss_coeff=0.1))


def with_arg(i, value):
    case = base()
    case["args"][i] = value
    return case


def with_kwargs(**kwargs):
    case = base()
    case["kwargs"].update(kwargs)
    return case


x = make_inputs(T)
BAD_CALLS = {  # name: (case, error type, text the message must contain)
    "q_not_a_tensor": (with_arg(0, [1.0]), TypeError, "q must be a torch.Tensor"),
    "q_rank": (with_arg(0, x["q"][:, 0]), ValueError, "q must have shape [T, H, D_qk]"),
    "q_int": (with_arg(0, x["q"].int()), TypeError, "q must be"),
    "q_no_heads": (with_arg(0, x["q"][:, :0]), ValueError, "H = 0"),
    "q_tokens": (with_arg(0, x["q"][:9]), ValueError, "q has 9 tokens"),
    "kv_width": (with_arg(1, x["kv"][:, :7]), ValueError, "kv must have shape [T, D_qk]"),
    "kv_dtype": (with_arg(1, x["kv"].double()), TypeError, "kv has dtype"),
    "kv_tokens": (with_arg(1, x["kv"][:9]), ValueError, "kv has 9 tokens"),
    "kv_device": (with_arg(1, x["kv"].to("meta")), ValueError, "kv is on meta"),
    "q_idx_rank": (with_arg(2, x["q_idx"][0]), ValueError, "q_idx must have shape"),
    "q_idx_fp8": (with_arg(2, x["q_idx"].to(torch.float8_e4m3fn)), TypeError, "q_idx must be"),
    "k_idx_width": (with_arg(3, x["k_idx"][:, :3]), ValueError, "k_idx must have shape"),
    "k_idx_dtype": (with_arg(3, x["k_idx"].bfloat16()), TypeError, "k_idx has dtype"),
    "k_idx_tokens": (with_arg(3, x["k_idx"][:3]), ValueError, "k_idx has 3 tokens"),
    "w_heads": (with_arg(4, x["w"][:, :1]), ValueError, "w must have shape [T, H_idx]"),
    "w_int": (with_arg(4, x["w"].long()), TypeError, "w must be"),
    "w_device": (with_arg(4, x["w"].to("meta")), ValueError, "w is on meta"),
    "topk_zero": (with_kwargs(topk=0), ValueError, "topk must be >= 1"),
    "topk_float": (with_kwargs(topk=4.0), TypeError, "topk must be an int"),
    "topk_bool": (with_kwargs(topk=True), TypeError, "topk must be an int"),
    "d_v_zero": (with_kwargs(d_v=0), ValueError, "d_v must be >= 1"),
    "d_v_too_wide": (with_kwargs(d_v=25), ValueError, "d_v (the value columns of kv)"),
    "scale_nan": (with_kwargs(scale=float("nan")), ValueError, "scale must be finite"),
    "scale_str": (with_kwargs(scale="0.3"), TypeError, "scale must be a float"),
    "coeff_inf": (with_kwargs(indexer_loss_coeff=float("inf")), ValueError, "indexer_loss_coeff"),
    "reduction": (with_kwargs(indexer_loss_reduction="avg"), ValueError, "indexer_loss_reduction"),
    "cu_float": (with_kwargs(cu_seqlens=torch.tensor([0.0, 10.0])), TypeError, "cu_seqlens must be an int32"),
    "cu_rank": (with_kwargs(cu_seqlens=torch.tensor([[0, 10]])), ValueError, "cu_seqlens must be 1-D"),
    "cu_single": (with_kwargs(cu_seqlens=torch.tensor([0])), ValueError, "cu_seqlens must be 1-D"),
    "cu_start": (with_kwargs(cu_seqlens=torch.tensor([1, 10])), ValueError, "cu_seqlens must start at 0"),
    "cu_decreasing": (with_kwargs(cu_seqlens=torch.tensor([0, 6, 4, 10])), ValueError, "non-decreasing"),
    "cu_past_T": (with_kwargs(cu_seqlens=torch.tensor([0, 11])), ValueError, "at most at the token count"),
    "cu_device": (with_kwargs(cu_seqlens=torch.tensor([0, 10], device="meta")), ValueError, "cu_seqlens is on meta"),
    "cu_cpu_alone": (with_kwargs(cu_seqlens_cpu=torch.tensor([0, 10])), ValueError, "cu_seqlens_cpu was given"),
    "cu_cpu_shape": (with_kwargs(cu_seqlens=torch.tensor([0, 10]), cu_seqlens_cpu=torch.tensor([0, 5, 10])),
                     ValueError, "cu_seqlens_cpu must be"),
    "cu_cpu_values": (with_kwargs(cu_seqlens=torch.tensor([0, 10]), cu_seqlens_cpu=torch.tensor([0, 12])),
                      ValueError, "at most at the token count"),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_dsa_attention_rejects(name):
    case, error, text = BAD_CALLS[name]
    counter = DsaOpCounter()
    with counter, pytest.raises(error, match=_literal(text)):
        dsa.dsa_attention(*case["args"], **case["kwargs"])
    assert not counter.counts  # raised before any op ran


def _literal(text):
    import re
    return re.escape(text)


def good_indices():
    """Valid for cu_seqlens [0, 4, 8] (tokens 8, 9 padding), topk 3."""
    rows = [[0, -1, -1], [1, 0, -1], [2, -1, 0], [3, 1, 2], [4, -1, -1], [5, 4, -1],
            [-1, 6, 5], [7, -1, 4], [-1, -1, -1], [-1, -1, -1]]
    return torch.tensor(rows, dtype=torch.int32)


CU = torch.tensor([0, 4, 8])


def _indices_with(row, slot, value):
    idx = good_indices()
    idx[row, slot] = value
    return idx


BAD_INDICES = {  # name: (indices, text)
    "int64": (good_indices().long(), "indices must be int32"),
    "rank": (good_indices()[:, 0], "indices must have shape [T, k]"),
    "tokens": (good_indices()[:9], "indices must have shape [T, k]"),
    "below_minus_one": (_indices_with(3, 1, -2), "indices must lie in [-1, T=10)"),
    "past_T": (_indices_with(3, 1, 10), "indices must lie in [-1, T=10)"),
    "future": (_indices_with(2, 1, 3), "indices[2, 1] = 3 is not a key query 2 may see"),
    "other_sequence": (_indices_with(5, 2, 3), "indices[5, 2] = 3 is not a key query 5 may see"),
    "padding_row": (_indices_with(9, 0, 7), "its token belongs to no sequence"),
    "repeated": (_indices_with(3, 1, 2), "selects key 2 twice"),
}


@pytest.mark.parametrize("name", BAD_INDICES)
def test_sparse_mla_rejects_indices(name):
    indices, text = BAD_INDICES[name]
    counter = DsaOpCounter()
    with counter, pytest.raises((ValueError, TypeError), match=_literal(text)):
        dsa.sparse_mla(x["q"], x["kv"], indices, scale=0.3, d_v=16, cu_seqlens=CU)
    assert not counter.counts


def test_good_indices_pass():
    o, lse = dsa.sparse_mla(x["q"], x["kv"], good_indices(), scale=0.3, d_v=16, cu_seqlens=CU)
    assert torch.isneginf(lse[8:]).all() and torch.isfinite(lse[:8]).all()


def test_one_sequence_indices_must_be_causal():
    with pytest.raises(ValueError, match="future"):
        dsa.sparse_mla(x["q"], x["kv"], _indices_with(0, 1, 1), scale=0.3, d_v=16)


def _loss_args():
    indices = good_indices()
    o, lse = dsa.sparse_mla(x["q"], x["kv"], indices, scale=0.3, d_v=16, cu_seqlens=CU)
    scores = torch.ops.dsa.indexer_fwd(x["q_idx"], x["k_idx"], x["w"], indices)
    return dict(scores=scores, q=x["q"], kv=x["kv"], indices=indices, lse=lse)


BAD_LOSS = {  # name: (override, keyword override, error, text)
    "scores_shape": (dict(scores=torch.zeros(T, 2)), {}, ValueError, "scores must have the shape of indices"),
    "scores_int": (dict(scores=torch.zeros(T, 3, dtype=torch.int32)), {}, TypeError, "scores must be"),
    "lse_shape": (dict(lse=torch.zeros(T, 2)), {}, ValueError, "lse must have shape [T, H]"),
    "lse_not_a_tensor": (dict(lse=0.0), {}, TypeError, "lse must be a torch.Tensor"),
    "indices": (dict(indices=_indices_with(2, 1, 3)), {}, ValueError, "is not a key query 2 may see"),
    "reduction": ({}, dict(reduction="none"), ValueError, "reduction must be one of"),
    "coeff": ({}, dict(coeff=float("nan")), ValueError, "coeff must be finite"),
}


@pytest.mark.parametrize("name", BAD_LOSS)
def test_indexer_kl_loss_rejects(name):
    override, kw, error, text = BAD_LOSS[name]
    args = _loss_args() | override
    with pytest.raises(error, match=_literal(text)):
        dsa.indexer_kl_loss(*args.values(), scale=0.3, cu_seqlens=CU, **kw)


def test_indexer_topk_rejects():
    with pytest.raises(ValueError, match="topk must be >= 1"):
        dsa.indexer_topk(x["q_idx"], x["k_idx"], x["w"], 0)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        dsa.indexer_topk(x["q_idx"], x["k_idx"], x["w"], 2, cu_seqlens=torch.tensor([2, 10]))


# The op bodies' own checks: what a compiled graph relies on (its trace reads no values).
def test_topk_op_checks_cu_seqlens_values():
    with pytest.raises(ValueError, match="non-decreasing"):
        torch.ops.dsa.indexer_topk(x["q_idx"], x["k_idx"], x["w"], torch.tensor([0, 6, 4, 10]), 3)


@pytest.mark.parametrize("value", [-2, 10])
def test_ops_check_the_index_range(value):
    idx = _indices_with(3, 1, value)
    with pytest.raises(ValueError, match="indices must lie in"):
        torch.ops.dsa.sparse_mla_fwd(x["q"], x["kv"], idx, 0.3, 16)
    with pytest.raises(ValueError, match="indices must lie in"):
        torch.ops.dsa.indexer_fwd(x["q_idx"], x["k_idx"], x["w"], idx)


def test_loss_op_checks_the_reduction():
    args = _loss_args()
    with pytest.raises(ValueError, match="reduction"):
        torch.ops.dsa.indexer_loss_fwd(*args.values(), 0.3, 1.0, "none")
