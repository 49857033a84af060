"""The state-pool decode entry (torch_dplr.serving, dplr::decode_pool): its op contract, its
in-place pool update, one call for requests with different histories, and its errors."""
from __future__ import annotations

import pytest
import torch

import torch_dplr
from torch_dplr import serving
from torch_dplr.testing import TOLERANCES, make_inputs, recurrence_oracle, rms_ratio

H, K, V = 2, 8, 6
NAMES = ("q", "k", "v", "a", "b", "gk")


def _inputs(B, T, dtype=torch.float32, seed=0, V=V):
    x = make_inputs(B, T, H, K, V, dtype=dtype, seed=seed)
    return [x[n] for n in NAMES]


def _pool(slots, dtype=torch.float32, seed=1, V=V):
    return torch.randn(slots, H, K, V, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _slots(*values):
    return torch.tensor(values, dtype=torch.int32)


def _opcheck_samples():
    # (inputs, pool, slots, cu_seqlens, scale): rect T=1 (decode), rect T=3, varlen with an
    # empty and a one-token request, fp64 and bf16
    empty = torch.empty(0, dtype=torch.int64)
    yield _inputs(3, 1), _pool(5), _slots(4, 0, 2), empty, 0.5
    yield _inputs(2, 3, torch.bfloat16), _pool(4), _slots(1, 3), empty, 1.0
    yield _inputs(1, 7, torch.float64), _pool(6, torch.float64), _slots(5, 1, 2), \
        torch.tensor([0, 0, 1, 7], dtype=torch.int32), K ** -0.5


@pytest.mark.parametrize("sample", range(3))
def test_opcheck(sample):
    tensors, pool, slots, cu, scale = list(_opcheck_samples())[sample]
    torch.library.opcheck(torch.ops.dplr.decode_pool.default,
                          (*tensors, pool, slots, cu, scale))


def test_schema_declares_the_pool_mutated():
    schema = torch.ops.dplr.decode_pool.default._schema
    mutated = [arg.name for arg in schema.arguments if arg.alias_info and arg.alias_info.is_write]
    assert mutated == ["state_pool"]
    assert len(schema.returns) == 1


@pytest.mark.parametrize("T", [1, 4])
def test_rect_call_advances_named_slots_in_place(T):
    q, k, v, a, b, gk = _inputs(3, T, torch.float64)
    pool = _pool(7, torch.float64)
    slots = _slots(5, 0, 3)
    before, storage = pool.clone(), pool.data_ptr()
    o = torch_dplr.dplr_decode(q, k, v, a, b, gk, pool, slots, scale=0.7)
    o_ref, h_ref = recurrence_oracle(q, k, v, a, b, gk, 0.7, before[slots.long()])
    assert pool.data_ptr() == storage
    assert rms_ratio(o, o_ref) < TOLERANCES[torch.float64][0]
    assert rms_ratio(pool[slots.long()], h_ref) < TOLERANCES[torch.float64][0]
    untouched = [1, 2, 4, 6]
    assert torch.equal(pool[untouched], before[untouched])


def test_one_call_equals_one_call_per_request():
    """Requests with different histories (states) and different token counts in one varlen
    call give each request what a call of its own gives."""
    lengths = [1, 3, 0, 2]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, a, b, gk = _inputs(1, int(cu[-1]), torch.float64, seed=3)
    pool = _pool(9, torch.float64)
    slots = _slots(8, 2, 5, 0)
    separate = pool.clone()
    o = torch_dplr.dplr_decode(q, k, v, a, b, gk, pool, slots, cu_seqlens=cu)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = [x[:, start:end] for x in (q, k, v, a, b, gk)]
        o_n = torch_dplr.dplr_decode(*part, separate, slots[n:n + 1])
        torch.testing.assert_close(o[:, start:end], o_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pool, separate, rtol=1e-12, atol=1e-12)


def test_rwkv7_entry_is_the_dplr_entry_with_scale_one():
    r, k, v, a, b, w = _inputs(2, 1)
    pool_a, pool_b = _pool(3), _pool(3)
    slots = _slots(2, 0)
    o1 = torch_dplr.rwkv7_decode(r, w, k, v, a, b, pool_a, slots)
    o2 = torch_dplr.dplr_decode(r, k, v, a, b, w, pool_b, slots, scale=1.0)
    assert torch.equal(o1, o2) and torch.equal(pool_a, pool_b)


def test_bf16_inputs_against_the_fp64_oracle():
    q, k, v, a, b, gk = _inputs(4, 3, torch.bfloat16, seed=5)
    pool = _pool(6)
    slots = _slots(3, 5, 0, 1)
    h0 = pool[slots.long()].clone()
    o = torch_dplr.dplr_decode(q, k, v, a, b, gk, pool, slots)
    o_ref, h_ref = recurrence_oracle(q, k, v, a, b, gk, K ** -0.5, h0)
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    assert rms_ratio(o, o_ref) < TOLERANCES[torch.bfloat16][0]
    assert rms_ratio(pool[slots.long()], h_ref) < TOLERANCES[torch.float32][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cu", [None, [0, 1, 4, 4, 6]], ids=["rect", "varlen"])
def test_bf16_pool_is_the_fp32_step_rounded_once(dtype, cu):
    """A bf16 pool: each request's state read into fp32, advanced in fp32 through all its
    tokens and rounded to bf16 once when written back; o is what the fp32 step gives."""
    B, T = (4, 3) if cu is None else (1, 6)
    q, k, v, a, b, gk = _inputs(B, T, dtype, seed=7)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    pool = _pool(6).to(torch.bfloat16)
    wide = pool.float()
    slots = _slots(3, 5, 0, 1)
    with torch.no_grad():
        o = torch_dplr.dplr_decode(q, k, v, a, b, gk, pool, slots, cu_seqlens=cu_t)
        o_wide = torch_dplr.dplr_decode(q, k, v, a, b, gk, wide, slots, cu_seqlens=cu_t)
    assert pool.dtype == torch.bfloat16 and torch.equal(o, o_wide)
    assert torch.equal(pool, wide.to(torch.bfloat16))


def test_bf16_pool_refused_for_fp64_data():
    q, k, v, a, b, gk = _inputs(2, 1, torch.float64)
    with pytest.raises(TypeError, match=r"state_pool must be torch.float64 .*got torch.bfloat16"):
        torch_dplr.dplr_decode(q, k, v, a, b, gk, _pool(3).to(torch.bfloat16), _slots(0, 1))


def test_compiled_call_updates_the_pool():
    q, k, v, a, b, gk = _inputs(3, 1)
    pool, pool_eager = _pool(5), _pool(5)
    slots = _slots(4, 1, 2)

    def step(q, k, v, a, b, gk, pool, slots):
        return torch_dplr.dplr_decode(q, k, v, a, b, gk, pool, slots) * 2

    torch._dynamo.reset()
    o = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, a, b, gk, pool, slots)
    o_eager = step(q, k, v, a, b, gk, pool_eager, slots)
    torch.testing.assert_close(o, o_eager)
    torch.testing.assert_close(pool, pool_eager)
    # the host checks are skipped while tracing; the CPU kernel still refuses a bad slot
    with pytest.raises(Exception, match="at most once"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, a, b, gk, pool,
                                                                 _slots(4, 4, 2))
    torch._dynamo.reset()


def test_value_checks_read_only_the_host_copies(monkeypatch):
    """With the CPU copies given, the value checks read them (no device sync); while the
    checks cannot run (tracing, graph capture) they read nothing.  (The op is stood in: only
    the entry's own reads are counted.)"""
    q, k, v, a, b, gk = _inputs(1, 3)
    tensors = dict(q=q, k=k, v=v, a=a, b=b, gk=gk)
    cu, pool, slots = torch.tensor([0, 1, 3], dtype=torch.int32), _pool(4), _slots(3, 1)
    read = []
    real_tolist = torch.Tensor.tolist

    def spying_tolist(t):
        read.append(t.data_ptr())
        return real_tolist(t)

    ran = []
    monkeypatch.setattr(torch.ops.dplr, "decode_pool", lambda *args: ran.append(args))
    monkeypatch.setattr(torch.Tensor, "tolist", spying_tolist)
    cu_cpu, slots_cpu = cu.clone(), slots.clone()
    serving._decode(tensors, "gk", pool, slots, None, cu, cu_cpu, slots_cpu, True)
    assert set(read) == {cu_cpu.data_ptr(), slots_cpu.data_ptr()}
    read.clear()
    serving._decode(tensors, "gk", pool, slots, None, cu, None, None, True)
    assert set(read) == {cu.data_ptr(), slots.data_ptr()}  # eager, no copies: the tensors
    read.clear()
    monkeypatch.setattr(serving, "_host_checks_can_run", lambda x: False)
    serving._decode(tensors, "gk", pool, _slots(3, 3), None, cu, None, None, True)
    assert read == [] and len(ran) == 3


def _call(**changes):
    q, k, v, a, b, gk = _inputs(3, 1)
    args = dict(q=q, k=k, v=v, a=a, b=b, gk=gk, state_pool=_pool(5), slot_indices=_slots(0, 2, 4))
    args.update(changes)
    return torch_dplr.dplr_decode(**args)


@pytest.mark.parametrize("changes,error,match", [
    (dict(slot_indices=_slots(0, 2, 5)), ValueError, r"slot_indices must lie in \[0, 5\).*5"),
    (dict(slot_indices=_slots(0, -1, 2)), ValueError, r"slot_indices must lie in \[0, 5\).*-1"),
    (dict(slot_indices=_slots(1, 3, 1)), ValueError, r"at most once.*\[1\]"),
    (dict(slot_indices=_slots(0, 2, 4).long()), TypeError, "slot_indices must be int32"),
    (dict(slot_indices=_slots(0, 2)), ValueError, r"slot_indices must have shape \[N\] = \[3\]"),
    (dict(slot_indices=[0, 2, 4]), TypeError, "slot_indices must be a torch.Tensor"),
    (dict(slot_indices=_slots(0, 2, 4).to("meta")), ValueError, "slot_indices is on meta"),
    (dict(state_pool=_pool(5, V=4)), ValueError,
     r"state_pool must have shape .*\[slots, 2, 8, 6\], got \(5, 2, 8, 4\)"),
    (dict(state_pool=_pool(5)[:, :1]), ValueError, "state_pool must have shape"),
    (dict(state_pool=_pool(5).to(torch.float16)), TypeError,
     "state_pool must be torch.float32 or torch.bfloat16 .*got torch.float16"),
    (dict(state_pool=_pool(5, torch.float64)), TypeError,
     "state_pool must be torch.float32 or torch.bfloat16"),
    (dict(state_pool=_pool(5).transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
     "state_pool must be contiguous"),
    (dict(state_pool=_pool(5).to("meta")), ValueError, "state_pool is on meta"),
    (dict(state_pool=None), TypeError, "state_pool must be a torch.Tensor"),
    (dict(cu_seqlens=torch.tensor([0, 1, 2, 3])), ValueError, "batch size must be 1"),
    (dict(v=_inputs(3, 1)[2][..., :4]), ValueError, "state_pool must have shape"),
    (dict(gk=_inputs(3, 2)[5]), ValueError, "gk must have the shape of q"),
])
def test_bad_input_raises_naming_the_argument(changes, error, match):
    with torch.no_grad(), pytest.raises(error, match=match):
        _call(**changes)


def test_bad_varlen_offsets_raise():
    q, k, v, a, b, gk = _inputs(1, 4)
    for cu, match in (([0, 3, 2], "non-decreasing"), ([0, 1, 3], "end at the token count")):
        with pytest.raises(ValueError, match=match):
            torch_dplr.dplr_decode(q, k, v, a, b, gk, _pool(4), _slots(0, 1),
                                   cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_cpu was given without cu_seqlens"):
        torch_dplr.dplr_decode(*_inputs(2, 1), _pool(4), _slots(0, 1),
                               cu_seqlens_cpu=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="cu_seqlens_cpu must be an integer CPU tensor"):
        torch_dplr.dplr_decode(q, k, v, a, b, gk, _pool(4), _slots(0, 1),
                               cu_seqlens=torch.tensor([0, 1, 4]),
                               cu_seqlens_cpu=torch.tensor([0, 4]))


def test_inputs_requiring_grad_are_refused():
    q, k, v, a, b, gk = _inputs(3, 1)
    v.requires_grad_()
    pool = _pool(5)
    with pytest.raises(ValueError, match="v requires grad.*no backward"):
        torch_dplr.dplr_decode(q, k, v, a, b, gk, pool, _slots(0, 1, 2))
    with torch.no_grad():
        torch_dplr.dplr_decode(q, k, v, a, b, gk, pool, _slots(0, 1, 2))


def test_new_state_pool():
    pool = torch_dplr.new_state_pool(4, H, K, V)
    assert pool.shape == (4, H, K, V) and pool.dtype == torch.float32 and not pool.any()
