"""Each stage's backward op against numerical differentiation of its forward op (fp64)."""
import pytest
import torch

import torch_dplr  # noqa: F401
from torch_dplr.testing import make_inputs

CASES = {"rect": (2, 11, None), "varlen": (1, 13, [0, 1, 6, 6, 13])}


def _inputs(case, gates="rwkv7"):
    B, T, cu = CASES[case]
    inp = make_inputs(B, T, 1, 4, 3, dtype=torch.float64, gates=gates,
                      num_states=B if cu is None else len(cu) - 1)
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    return inp, cu_t


def _req(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gates", ["rwkv7", "unbounded"])
def test_intra(case, gates):
    inp, cu = _inputs(case, gates)
    xs = _req(*(inp[n] for n in "q k a b gk".split()))
    fn = lambda *t: torch.ops.dplr.chunk_intra_fwd(*t, cu, 0.7, 4, float("-inf"))  # noqa: E731
    assert torch.autograd.gradcheck(fn, xs, fast_mode=True)


@pytest.mark.parametrize("case", list(CASES))
def test_wy(case):
    inp, cu = _inputs(case)
    out = torch.ops.dplr.chunk_intra_fwd(*(inp[n] for n in "q k a b gk".split()), cu, 0.7, 4,
                                         float("-inf"))
    xs = _req(out[4], out[3], out[7], inp["v"])
    fn = lambda *t: torch.ops.dplr.chunk_wy_fwd(*t, cu, 4)[1:]  # noqa: E731
    assert torch.autograd.gradcheck(fn, xs, fast_mode=True)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("use_h0", [True, False])
def test_state(case, use_h0):
    inp, cu = _inputs(case)
    gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = torch.ops.dplr.chunk_intra_fwd(
        *(inp[n] for n in "q k a b gk".split()), cu, 0.7, 4, float("-inf"))
    _, w, u = torch.ops.dplr.chunk_wy_fwd(A_ab, A_ak, ag, inp["v"], cu, 4)
    h0 = inp["initial_state"] if use_h0 else inp["initial_state"].new_empty(0)
    xs = _req(qg, kg, bg, w, u, inp["v"], A_qk, A_qb, gl, h0)
    if not use_h0:
        xs[-1].requires_grad_(False)
    fn = lambda *t: torch.ops.dplr.chunk_state_fwd(*t, cu, 4, use_h0, True)[:2]  # noqa: E731
    assert torch.autograd.gradcheck(fn, xs, fast_mode=True)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("reverse", [False, True])
def test_recurrent(case, reverse):
    inp, cu = _inputs(case, "unbounded")
    xs = _req(*(inp[n] for n in "q k v a b gk initial_state".split()))
    fn = lambda *t: torch.ops.dplr.recurrent_fwd(*t, cu, 0.7, True, reverse)  # noqa: E731
    assert torch.autograd.gradcheck(fn, xs, fast_mode=True)
