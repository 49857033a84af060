"""The top-k selection (dsa::indexer_topk) against torch.topk on the dense index scores, ties
included; its block merging; its memory (never the [T, T] score matrix); the selected scores."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_dplr  # noqa: F401
from torch_dplr.dsa import indexer_topk
from torch_dplr.dsa.reference import topk as topk_ref
from torch_dplr.dsa.reference.layout import key_starts
from torch_dplr.dsa.testing import dense_index_scores, dense_topk, make_inputs, visible_mask

dsa = torch.ops.dsa
CASES = {  # name: (T, cu_seqlens, topk)
    "one_sequence": (70, None, 9),
    "packed": (61, [0, 1, 1, 20, 21, 55], 7),     # 1-token, empty, padding tail of 6
    "topk_beyond_T": (12, [0, 4, 12], 20),
}


def _cu(cu):
    return None if cu is None else torch.tensor(cu)


def assert_matches_torch_topk(indices, q_idx, k_idx, w, topk, cu):
    """Selected scores == torch.topk's values row by row (the multiset of the k best visible
    scores), every index visible, ascending, -1 only after the valid ones."""
    T = q_idx.shape[0]
    visible = visible_mask(T, cu)
    dense = dense_index_scores(q_idx, k_idx, w).masked_fill(~visible, float("-inf"))
    counts = visible.sum(1).clamp(max=topk)
    valid = indices >= 0
    assert torch.equal(valid.sum(1), counts)
    # valid slots first, ascending and distinct
    assert torch.equal(valid, torch.arange(topk)[None, :] < counts[:, None])
    idx = indices.long()
    assert (idx[:, 1:] > idx[:, :-1])[valid[:, 1:]].all()
    assert visible.gather(1, idx.clamp(min=0))[valid].all()
    k = min(topk, T)
    expected = torch.topk(dense, k, dim=1).values if k else dense[:, :0]
    ours = dense.gather(1, idx.clamp(min=0)).masked_fill(~valid, float("-inf"))
    ours = ours.sort(dim=1, descending=True).values[:, :k]
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("case", CASES)
def test_topk_equals_torch_topk_fp64(case):
    T, cu, topk = CASES[case]
    x = make_inputs(T, dtype=torch.float64, seed=5)
    indices, _ = indexer_topk(x["q_idx"], x["k_idx"], x["w"], topk, cu_seqlens=_cu(cu))
    assert indices.dtype == torch.int32 and indices.shape == (T, topk)
    assert_matches_torch_topk(indices, x["q_idx"], x["k_idx"], x["w"], topk, cu)
    assert torch.equal(indices, dense_topk(x["q_idx"], x["k_idx"], x["w"], topk, cu))


def tie_inputs(T, dtype, seed=0):
    """Small integers: every score is exact in any float dtype, and many are equal (duplicate
    keys, ReLU zeros), so the choice among equal scores decides the result."""
    gen = torch.Generator().manual_seed(seed)
    ints = lambda *s, lo=-1, hi=2: torch.randint(lo, hi, s, generator=gen).to(dtype)  # noqa: E731
    return ints(T, 2, 4), ints(T, 4), ints(T, 2, lo=1, hi=3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES)
def test_ties_go_to_the_earlier_key(case, dtype):
    T, cu, topk = CASES[case]
    q_idx, k_idx, w = tie_inputs(T, dtype)
    scores = dense_index_scores(q_idx, k_idx, w)
    assert (scores == 0).float().mean() > 0.2  # the inputs do tie
    indices, _ = indexer_topk(q_idx, k_idx, w, topk, cu_seqlens=_cu(cu))
    assert_matches_torch_topk(indices, q_idx, k_idx, w, topk, cu)
    assert torch.equal(indices, dense_topk(q_idx, k_idx, w, topk, cu))


def _reference(q_idx, k_idx, w, cu, topk, block_q, block_k):
    T = q_idx.shape[0]
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    out = torch.empty(T, topk, dtype=torch.int32)
    return topk_ref.indexer_topk(q_idx.double(), k_idx.double(), w.double(), cu_t, topk, out,
                                 block_q, block_k)


@pytest.mark.parametrize("blocks", [(1, 1), (3, 5), (16, 7), (64, 64)])
def test_block_sizes_do_not_change_the_selection(blocks):
    """Query and key blocks merge into the same selection, ties included."""
    T, cu, topk = CASES["packed"]
    for q_idx, k_idx, w in (tie_inputs(T, torch.float64, seed=2),
                            tuple(make_inputs(T, dtype=torch.float64)[n] for n in ("q_idx", "k_idx", "w"))):
        expected = dense_topk(q_idx, k_idx, w, topk, cu)
        assert torch.equal(_reference(q_idx, k_idx, w, cu, topk, *blocks), expected)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_score_matrix_is_never_held():
    """At T = 1024 the selection's largest tensor (its [T, topk] output, then a block's
    per-head scores) stays a small fraction of T², while the dense rule it matches needs all
    of it."""
    T, topk = 1024, 32
    x = make_inputs(T, H_idx=2, D_idx=8, dtype=torch.float64, seed=7)
    mode = LargestTensor()
    with mode:
        got = _reference(x["q_idx"], x["k_idx"], x["w"], [0, 600, T], topk, 64, 128)
    assert mode.largest <= max(T * topk, 64 * 2 * 128) <= T * T // 32
    assert torch.equal(got, dense_topk(x["q_idx"], x["k_idx"], x["w"], topk, [0, 600, T]))


@pytest.mark.parametrize("H_idx,topk", [(64, 2048), (8, 2048), (64, 64), (1, 1)])
def test_default_blocks_are_bounded_whatever_T(H_idx, topk):
    """The op's blocks depend on H_idx and topk only (DeepSeek-V3.2: 64 index heads, 2048)."""
    block_q, block_k = topk_ref.block_sizes(H_idx, topk)
    assert 1 <= block_q and block_q * (H_idx * block_k + topk) <= topk_ref.BLOCK_ELEMENTS


def test_selected_scores_are_the_dense_scores():
    T, cu, topk = CASES["packed"]
    x = make_inputs(T, dtype=torch.float64)
    indices, scores = indexer_topk(x["q_idx"], x["k_idx"], x["w"], topk, cu_seqlens=_cu(cu))
    dense = dense_index_scores(x["q_idx"], x["k_idx"], x["w"])
    valid = indices >= 0
    gathered = dense.gather(1, indices.long().clamp(min=0))
    torch.testing.assert_close(scores[valid], gathered[valid], rtol=1e-13, atol=1e-13)
    assert torch.isneginf(scores[~valid]).all() and scores.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_low_precision_scores_accumulate_in_fp32(dtype):
    T, cu, topk = CASES["packed"]
    x = make_inputs(T, dtype=dtype)
    indices, scores = indexer_topk(x["q_idx"], x["k_idx"], x["w"], topk, cu_seqlens=_cu(cu))
    assert scores.dtype == torch.float32
    valid = indices >= 0
    dense = dense_index_scores(x["q_idx"], x["k_idx"], x["w"])  # fp64 of the same rounded inputs
    err = (scores.double() - dense.gather(1, indices.long().clamp(min=0)))[valid].abs().max()
    assert err <= 1e-6 * dense.abs().max()


def test_key_starts():
    starts = key_starts(torch.tensor([0, 0, 3, 4, 4, 6]), 8, "cpu")
    assert starts.tolist() == [0, 0, 0, 3, 4, 4, 7, 8]
    assert key_starts(torch.empty(0, dtype=torch.int64), 3, "cpu").tolist() == [0, 0, 0]
