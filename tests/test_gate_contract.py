"""Gates outside the documented ``gk <= 0`` (README, *Gate bounds*), on the PyTorch kernels:
a NaN gate gives NaN only in its own sequence and head, and a positive gate gives the
recurrence as written (growth instead of decay), exactly; a declared bound that the gates
break changes nothing (the PyTorch kernels never use it)."""
import pytest
import torch

import torch_dplr
from torch_dplr.testing import RWKV7_BOUND, make_inputs, recurrence_oracle, rms_ratio

CU = [0, 5, 40, 41, 90]  # four sequences, the second one spanning chunks


def _call(inp, chunk_size, lower_bound=None, cu=CU):
    args = [inp[n] for n in ("q", "k", "v", "a", "b", "gk")]
    return torch_dplr.chunk_dplr_delta_rule(*args, scale=0.5, initial_state=inp["initial_state"],
                                            output_final_state=True,
                                            cu_seqlens=torch.tensor(cu),
                                            chunk_size=chunk_size, lower_bound=lower_bound)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_nan_gate_stays_in_its_sequence_and_head(chunk_size):
    inp = make_inputs(1, 90, 3, 16, dtype=torch.float64, num_states=4)
    clean_o, clean_ht = _call(inp, chunk_size)
    inp["gk"][0, 20, 1, 4] = float("nan")  # sequence 1 (tokens 5-39), head 1
    o, ht = _call(inp, chunk_size)
    assert torch.isnan(o[0, 20:40, 1]).any() and torch.isnan(ht[1, 1]).any()
    keep_o = torch.ones_like(o, dtype=torch.bool)
    keep_o[0, 5:40, 1] = False
    keep_ht = torch.ones_like(ht, dtype=torch.bool)
    keep_ht[1, 1] = False
    assert torch.equal(o[keep_o], clean_o[keep_o])
    assert torch.equal(ht[keep_ht], clean_ht[keep_ht])


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_positive_gates_give_the_recurrence_as_written(chunk_size):
    inp = make_inputs(1, 90, 2, 16, dtype=torch.float64, num_states=4)
    inp["gk"] = inp["gk"].abs() * 0.05  # small growth per token: finite over 90 tokens
    o, ht = _call(inp, chunk_size)
    o_ref, ht_ref = recurrence_oracle(*(inp[n] for n in ("q", "k", "v", "a", "b", "gk")), 0.5,
                                      inp["initial_state"], torch.tensor(CU))
    assert rms_ratio(o, o_ref) < 1e-10 and rms_ratio(ht, ht_ref) < 1e-10


@pytest.mark.parametrize("factor", [2.0, 100.0])
def test_a_broken_bound_changes_nothing_on_the_pytorch_kernels(factor):
    inp = make_inputs(1, 90, 2, 16, dtype=torch.float64, num_states=4)
    inp["gk"] = inp["gk"] * factor
    o, ht = _call(inp, 64, lower_bound=RWKV7_BOUND)
    o_ref, ht_ref = _call(inp, 64)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
