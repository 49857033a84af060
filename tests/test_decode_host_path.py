"""The host path of the per-token entries (a decode step's Python around its one kernel):
what makes it cheap must change neither what a call computes nor what it refuses.

- ``call_op`` goes past the custom ops' autograd and in-place layers only where they would do
  nothing, and still bumps the state pool's version counter;
- the CUDA op bodies hand the per-token kernel the inputs themselves (contiguous, not the
  flattened views), and offsets / slot indices without copies when they are int32 already;
- the public per-token entries validate once, call their op through ``call_op`` and still
  compile (fullgraph) to a graph holding the op;
- the validation's one-pass check agrees with the detailed checks on every input, and bad
  input still raises the detailed checks' error, naming the argument, before any op runs.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_dplr
from torch_dplr import validation
from torch_dplr.ops import decode, recurrent
from torch_dplr.ops.direct_call import call_op
from torch_dplr.ops.varlen import as_one_sequence_list
from torch_dplr.testing import make_gates

H, K = 2, 16
EXCLUDED = torch._C._dispatch_tls_is_dispatch_key_excluded
KEYS = torch._C.DispatchKey


def _rwkv7(B=3, T=1, dtype=torch.bfloat16, seed=0, V=K):
    g = torch.Generator().manual_seed(seed)
    rand = lambda D=K: torch.randn(B, T, H, D, generator=g)  # noqa: E731
    kk = F.normalize(rand(), dim=-1)
    x = dict(r=rand(), k=rand() * K ** -0.5, v=rand(V), kk=kk, iclr=torch.sigmoid(rand()))
    x = {n: t.to(dtype) for n, t in x.items()}
    x["a"], x["b"] = -x["kk"], x["kk"] * x["iclr"]
    x["w"] = make_gates((B, T, H, K), "rwkv7", g)
    x["state"] = torch.randn(B, H, K, V, generator=g)
    return x


def _args(x, names="r w k v a b"):
    return [x[n] for n in names.split()]


def _slots(*s):
    return torch.tensor(s, dtype=torch.int32)


# ---- call_op: which dispatcher layers a call goes through --------------------------------

def _recording_op(seen):
    """Stands in for an op: records which layers the dispatcher would skip for it."""
    def op(*args):
        seen.append((EXCLUDED(KEYS.AutogradFunctionality), EXCLUDED(KEYS.ADInplaceOrView)))
        return args[0]
    return op


@pytest.mark.parametrize("grad_mode,requires_grad,skipped", [
    (torch.enable_grad, False, True),   # benchmarks/decode.py's calls: grad on, no leaf
    (torch.no_grad, True, True),
    (torch.inference_mode, False, True),
    (torch.enable_grad, True, False),   # a gradient is needed: every layer runs
])
def test_call_op_skips_the_autograd_layer_only_when_no_gradient_is_needed(
        grad_mode, requires_grad, skipped):
    x = torch.randn(3, requires_grad=requires_grad)
    seen = []
    with grad_mode():
        call_op(_recording_op(seen), x, 1.0)
    assert seen == [(skipped, False)]


def test_call_op_bumps_the_version_of_what_the_op_writes():
    pool, x = torch.zeros(4), torch.randn(4)
    seen, before = [], pool._version
    call_op(_recording_op(seen), x, pool, mutated=pool)
    assert seen == [(True, True)] and pool._version == before + 1


def test_call_op_keeps_the_in_place_layer_for_an_inference_tensor():
    with torch.inference_mode():
        pool = torch.zeros(4)
    seen = []
    with torch.no_grad():
        call_op(_recording_op(seen), torch.randn(4), pool, mutated=pool)
    assert seen == [(True, False)]


def test_decode_on_an_inference_pool_behaves_as_the_op():
    """Outside inference mode the op's in-place write refuses an inference tensor pool (on
    the PyTorch kernel); inside it both calls run and agree."""
    x = _rwkv7(seed=2)
    slots, empty = _slots(4, 0, 2), torch.empty(0, dtype=torch.int64)

    def op(pool):
        return torch.ops.dplr.decode_pool(*_args(x, "r k v a b w"), pool, slots, empty, 1.0)

    def entry(pool):
        return torch_dplr.rwkv7_decode(*_args(x), pool, slots)

    def error(f):
        with torch.inference_mode():
            pool = torch.zeros(5, H, K, K)
        try:
            with torch.no_grad():
                f(pool)
        except RuntimeError as e:
            return str(e)
        return None

    assert error(entry) == error(op) is not None
    with torch.inference_mode():
        want_pool, got_pool = torch.randn(5, H, K, K), torch.empty(5, H, K, K)
        got_pool.copy_(want_pool)
        want, got = op(want_pool), entry(got_pool)
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)


def test_call_op_under_a_functorch_transform_runs_every_layer():
    seen = []
    torch.func.vmap(lambda t: call_op(_recording_op(seen), t))(torch.randn(2, 3))
    assert seen == [(False, False)]


def test_decode_write_is_seen_by_autograd():
    """A tensor saved for backward and then overwritten by a decode step must fail the
    backward (the version counter the in-place layer would have bumped)."""
    x = _rwkv7()
    pool = torch.randn(5, H, K, K)
    leaf = torch.randn(5, H, K, K, requires_grad=True)
    loss = (leaf * pool).sum()  # saves pool
    with torch.no_grad():
        torch_dplr.rwkv7_decode(*_args(x), pool, _slots(0, 2, 4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("grad_mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_decode_equals_the_op_through_every_layer(grad_mode, dtype):
    x = _rwkv7(dtype=dtype, seed=1)
    sd = decode.state_dtype(dtype)
    pool = torch.randn(6, H, K, K, dtype=sd)
    slots = _slots(5, 0, 3)
    want_pool, got_pool = pool.clone(), pool.clone()
    empty = torch.empty(0, dtype=torch.int64)
    with grad_mode():
        want = torch.ops.dplr.decode_pool(*_args(x, "r k v a b w"), want_pool, slots, empty, 1.0)
        got = torch_dplr.rwkv7_decode(*_args(x), got_pool, slots)
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)


def test_dispatch_modes_still_see_the_ops():
    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = _rwkv7()
    with Record() as rec, torch.no_grad():
        torch_dplr.rwkv7_decode(*_args(x), torch.zeros(3, H, K, K), _slots(0, 1, 2))
        torch_dplr.fused_mul_recurrent_rwkv7(*_args(x, "r w k v kk iclr"),
                                             initial_state=x["state"])
    assert "dplr.decode_pool.default" in rec.ops and "dplr.recurrent_fwd.default" in rec.ops


def test_fused_mul_is_still_differentiable_and_equal_to_the_dplr_form():
    x = _rwkv7(dtype=torch.float64, T=3)
    x["w"] = x["w"].double()
    x["state"] = x["state"].double()
    leaves = {n: x[n].clone().requires_grad_() for n in ("r", "w", "k", "v", "kk", "iclr",
                                                          "state")}
    o, ht = torch_dplr.fused_mul_recurrent_rwkv7(
        *(leaves[n] for n in ("r", "w", "k", "v", "kk", "iclr")),
        initial_state=leaves["state"], output_final_state=True)
    assert o.grad_fn is not None
    grads = torch.autograd.grad((o.sum() + ht.sum()), list(leaves.values()))
    ref = {n: x[n].clone().requires_grad_() for n in leaves}
    o_ref, ht_ref = torch_dplr.fused_recurrent_rwkv7(
        ref["r"], ref["w"], ref["k"], ref["v"], -ref["kk"], ref["kk"] * ref["iclr"],
        initial_state=ref["state"], output_final_state=True)
    ref_grads = torch.autograd.grad((o_ref.sum() + ht_ref.sum()), list(ref.values()))
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_fused_mul_no_grad_equals_grad_mode():
    x = _rwkv7(T=2, seed=3)
    args = _args(x, "r w k v kk iclr")
    o, ht = torch_dplr.fused_mul_recurrent_rwkv7(*args, initial_state=x["state"],
                                                 output_final_state=True)
    with torch.inference_mode():
        o2, ht2 = torch_dplr.fused_mul_recurrent_rwkv7(*args, initial_state=x["state"],
                                                       output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def _per_token_steps(x):
    """Each per-token entry as a function of tensors only (the state pool last)."""
    slots = _slots(0, 2, 4)
    return {
        "fused_recurrent_rwkv7": lambda r, w, k, v, a, b, h0, pool:
            torch_dplr.fused_recurrent_rwkv7(r, w, k, v, a, b, initial_state=h0),
        "fused_recurrent_dplr_delta_rule": lambda r, w, k, v, a, b, h0, pool:
            torch_dplr.fused_recurrent_dplr_delta_rule(r, k, v, a, b, w, initial_state=h0,
                                                       output_final_state=True),
        "fused_mul_recurrent_rwkv7": lambda r, w, k, v, a, b, h0, pool:
            torch_dplr.fused_mul_recurrent_rwkv7(r, w, k, v, -a, b, initial_state=h0,
                                                 output_final_state=True),
        "rwkv7_decode": lambda r, w, k, v, a, b, h0, pool:
            (torch_dplr.rwkv7_decode(r, w, k, v, a, b, pool, slots, check_values=False),),
    }


PER_TOKEN_OPS = {"fused_recurrent_rwkv7": "dplr.recurrent_fwd",
                 "fused_recurrent_dplr_delta_rule": "dplr.recurrent_fwd",
                 "fused_mul_recurrent_rwkv7": "dplr.recurrent_fwd",
                 "rwkv7_decode": "dplr.decode_pool"}


@pytest.mark.parametrize("grad_mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("entry", list(PER_TOKEN_OPS))
def test_per_token_entries_compile_to_the_op(entry, grad_mode):
    """fullgraph: no graph break, and the graph holds the opaque op node."""
    x = _rwkv7(seed=4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    step = _per_token_steps(x)[entry]
    args = [*_args(x), x["state"]]
    want_pool, got_pool = torch.randn(5, H, K, K), torch.empty(5, H, K, K)
    got_pool.copy_(want_pool)
    torch._dynamo.reset()
    try:
        with grad_mode():
            got = torch.compile(step, fullgraph=True, backend=backend)(*args, got_pool)
            want = step(*args, want_pool)
    finally:
        torch._dynamo.reset()
    (graph,) = graphs
    assert PER_TOKEN_OPS[entry] in graph
    assert all(torch.equal(g, w) for g, w in zip(got, want) if g is not None)
    assert torch.equal(got_pool, want_pool)


@pytest.mark.parametrize("entry", list(PER_TOKEN_OPS))
def test_per_token_entries_under_fake_tensors(entry):
    x = _rwkv7(seed=5)
    with FakeTensorMode() as mode, torch.no_grad():
        fake = [mode.from_tensor(t) for t in (*_args(x), x["state"], torch.zeros(5, H, K, K))]
        out = _per_token_steps(x)[entry](*fake)
    assert isinstance(out[0], FakeTensor) and out[0].shape == x["v"].shape


@pytest.mark.parametrize("entry", list(PER_TOKEN_OPS)[:3])
def test_per_token_public_entries_validate_once_and_call_through_call_op(monkeypatch, entry):
    from torch_dplr import api, rwkv7
    checks, ops_called = [], []

    def counting(check):
        return lambda *a, **k: (checks.append(1), check(*a, **k))[1]

    def recording(op, *args, mutated=None):
        ops_called.append(str(op))
        return call_op(op, *args, mutated=mutated)

    monkeypatch.setattr(api, "check_inputs", counting(api.check_inputs))
    monkeypatch.setattr(rwkv7, "check_inputs", counting(rwkv7.check_inputs))
    monkeypatch.setattr(api, "call_op", recording)
    x = _rwkv7(seed=6)
    with torch.no_grad():
        _per_token_steps(x)[entry](*_args(x), x["state"], None)
    assert checks == [1] and ops_called == ["dplr.recurrent_fwd"]


@pytest.mark.parametrize("grad_mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
def test_fused_recurrent_equals_the_op_through_every_layer(grad_mode):
    x = _rwkv7(T=2, seed=7)
    empty = torch.empty(0, dtype=torch.int64)
    with grad_mode():
        want = torch.ops.dplr.recurrent_fwd(*_args(x, "r k v a b w"), x["state"], empty, 1.0,
                                            True, False)
        got = torch_dplr.fused_recurrent_rwkv7(*_args(x), initial_state=x["state"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- the CUDA op bodies' arguments to the per-token kernel -------------------------------

@pytest.fixture
def launches(monkeypatch):
    """The per-token kernel's launches, recorded instead of run (CPU tensors pass the bodies'
    "Triton runs here" check under TRITON_INTERPRET=1): positional arguments, then the
    keywords as one dict."""
    kernel = pytest.importorskip("csrc_triton.recurrent")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(kernel, "launch", lambda *args, **kwargs: calls.append((*args, kwargs)))
    return calls


def test_per_token_kernel_is_the_triton_module():
    kernel = pytest.importorskip("csrc_triton.recurrent")
    assert recurrent.per_token_kernel() is kernel


def _same_memory_as_the_token_list(arg, x):
    flat = as_one_sequence_list(x)
    return (arg.is_contiguous() and arg.shape[2:] == flat.shape[2:]
            and arg.data_ptr() == flat.data_ptr() and torch.equal(arg.reshape(flat.shape), flat))


@pytest.mark.parametrize("B,T,cu", [(3, 1, None), (2, 4, None), (1, 6, [0, 1, 1, 6])])
def test_recurrent_body_hands_the_kernel_its_inputs(launches, B, T, cu):
    x = _rwkv7(B=B, T=T, V=32, seed=5)
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, H, K, 32)
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu, dtype=torch.int32)
    tokens = _args(x, "r k v a b w")
    o, ht = recurrent.recurrent_fwd_cuda(*tokens, h0, cu_t, 0.5, True, False)
    (args,) = launches
    for arg, t in zip(args[:6], tokens):
        assert arg is t and _same_memory_as_the_token_list(arg, t)
    assert args[6] is h0 and args[9] is o and args[10] is ht
    assert args[7] is None  # no state rows: h0 row n is sequence n
    # a rect batch goes without offsets (the kernel cuts it); int32 offsets go as they are
    assert args[8] is (None if cu is None else cu_t)
    assert args[11:] == (0.5, True, False, False, {"rwkv7_pair": False})


def test_fused_mul_hands_the_op_kk_and_a():
    """No product formed outside the op: it gets RWKV-7's kk and a with the pair flag, and
    the ops a call dispatches are that one op alone."""
    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((str(func), args))
            return func(*args, **(kwargs or {}))

    x = _rwkv7(B=2, seed=8)
    with Calls() as rec, torch.no_grad():
        torch_dplr.fused_mul_recurrent_rwkv7(*_args(x, "r w k v kk iclr"),
                                             initial_state=x["state"])
    ((name, args),) = [c for c in rec.calls if c[0].startswith("dplr.")]
    assert name == "dplr.recurrent_fwd.default" and args[-1] is True
    assert args[3] is x["kk"] and args[4] is x["iclr"]
    assert not [c for c in rec.calls if c[0] in ("aten.neg.default", "aten.mul.Tensor")]


def test_recurrent_body_copies_what_is_not_contiguous(launches):
    x = _rwkv7(B=2, T=3, seed=6)
    strided = x["r"].transpose(0, 1).contiguous().transpose(0, 1)
    h0 = torch.randn(2, H, K, K).transpose(2, 3)
    cu64 = torch.tensor([0, 3], dtype=torch.int64)
    recurrent.recurrent_fwd_cuda(strided, *_args(x, "k v a b w"), h0, torch.empty(0), 1.0,
                                 True, True)
    recurrent.recurrent_fwd_cuda(*_args(_rwkv7(B=1, T=3), "r k v a b w"),
                                 torch.randn(1, H, K, K), cu64, 1.0, True, False)
    (first, second) = launches
    assert first[0].is_contiguous() and torch.equal(first[0], strided)
    assert first[6].is_contiguous() and torch.equal(first[6], h0) and first[-2] is True
    assert second[8].dtype == torch.int32 and torch.equal(second[8].long(), cu64)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_decode_body_hands_the_kernel_its_inputs(launches, slot_dtype):
    x = _rwkv7(B=3, seed=7)
    pool = torch.zeros(5, H, K, K)
    slots = torch.tensor([4, 0, 2], dtype=slot_dtype)
    tokens = _args(x, "r k v a b w")
    o = decode.decode_pool_cuda(*tokens, pool, slots, torch.empty(0, dtype=torch.int64), 0.7)
    (args,) = launches
    for arg, t in zip(args[:6], tokens):
        assert arg is t and _same_memory_as_the_token_list(arg, t)
    assert args[6] is pool and args[10] is pool and args[9] is o
    assert args[7].dtype == torch.int32 and torch.equal(args[7].long(), slots.long())
    assert (args[7] is slots) == (slot_dtype == torch.int32)
    assert args[8] is None  # a rect batch: no offsets tensor, one launch
    assert args[11:] == (0.7, True, True, False, {})


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("cu", [None, [0, 2, 2, 5]])
def test_bodies_on_strided_inputs_match_the_reference(monkeypatch, cu):
    """The bodies with the real kernel (Triton's interpreter) on inputs that are not
    contiguous: the same results as the PyTorch kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    B, T = (2, 3) if cu is None else (1, 5)
    x = _rwkv7(B=B, T=T, dtype=torch.float32, seed=8)
    tokens = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in _args(x, "r k v a b w")]
    N = B if cu is None else len(cu) - 1
    cu_t = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    h0 = torch.randn(N, H, K, K)
    for pair in (False, True):  # with the pair, a and b stand for RWKV-7's kk and a
        o, ht = recurrent.recurrent_fwd_cuda(*tokens, h0, cu_t, 0.5, True, False, pair)
        o_ref, ht_ref = recurrent.recurrent_fwd_reference(*tokens, h0, cu_t, 0.5, True, False,
                                                          pair)
        torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ht, ht_ref, rtol=1e-4, atol=1e-5)
    pool = torch.randn(4, H, K, K)
    slots = _slots(*range(3, 3 - N, -1))
    got_pool, want_pool = pool.clone(), pool.clone()
    o = decode.decode_pool_cuda(*tokens, got_pool, slots, cu_t, 0.5)
    o_ref = decode.decode_pool_reference(*tokens, want_pool, slots, cu_t, 0.5)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, rtol=1e-4, atol=1e-5)


# ---- validation: the one-pass check and the detailed checks ------------------------------

def _valid():
    x = _rwkv7(B=2, T=3)
    return dict(r=x["r"], k=x["k"], v=x["v"], a=x["a"], b=x["b"], w=x["w"])


def _changed(name, how):
    t = _valid()
    x = t[name]
    t[name] = {
        "shape": lambda: x[:, :2],
        "heads": lambda: x[:, :, :1],
        "head_dim": lambda: x[..., :8],
        "3d": lambda: x[0],
        "fp64": lambda: x.double(),
        "fp32": lambda: x.float(),
        "int": lambda: x.long(),
        "bool": lambda: x > 0,
        "complex": lambda: x.float().to(torch.complex64),
        "fp8": lambda: x.float().to(torch.float8_e4m3fn),
        "meta": lambda: x.to("meta"),
        "list": lambda: x.tolist(),
        "none": lambda: None,
    }[how]()
    return t


CHANGES = ("shape", "heads", "head_dim", "3d", "fp64", "fp32", "int", "bool", "complex", "fp8",
           "meta", "list", "none")


def _detailed_passes(t):
    try:
        validation._check_tensors(t, "w", "v")
    except (TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize("how", CHANGES)
@pytest.mark.parametrize("name", ["r", "k", "v", "a", "b", "w"])
def test_one_pass_check_agrees_with_the_detailed_checks(name, how):
    t = _changed(name, how)
    assert validation._tensors_agree(t, "w", "v") == _detailed_passes(t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_pass_check_accepts_valid_calls(dtype, gate_dtype):
    t = {n: x.to(dtype) for n, x in _valid().items()}
    t["w"] = t["w"].to(gate_dtype)
    t["v"] = torch.randn(2, 3, H, 32, dtype=dtype)  # V != K
    assert validation._tensors_agree(t, "w", "v") and _detailed_passes(t)


def _all_but_the_gate(how):
    t = _valid()
    return {n: (x if n == "w" else _changed(n, how)[n]) for n, x in t.items()}


# one case (or more) for each error the detailed checks raise, in their order
ERROR_CLASSES = [
    (lambda: _changed("k", "list"), TypeError, r"k must be a torch\.Tensor, got list"),
    (lambda: _changed("r", "none"), TypeError, r"r must be a torch\.Tensor, got NoneType"),
    (lambda: _changed("r", "3d"), ValueError, r"r must have shape \[B, T, H, K\]"),
    (lambda: _changed("a", "meta"), ValueError, r"a is on meta but r is on cpu"),
    (lambda: _changed("r", "meta"), ValueError, r"k is on cpu but r is on meta"),
    (lambda: _changed("b", "int"), TypeError, r"b must be a floating-point tensor"),
    (lambda: _changed("w", "bool"), TypeError, r"w must be a floating-point tensor"),
    (lambda: _changed("r", "complex"), TypeError, r"r must be a floating-point tensor"),
    (lambda: _changed("v", "heads"), ValueError, r"v must have shape \[B, T, H, V\]"),
    (lambda: _changed("v", "3d"), ValueError, r"v must have shape \[B, T, H, V\]"),
    (lambda: _changed("a", "head_dim"), ValueError, r"a must have the shape of r"),
    (lambda: _changed("w", "shape"), ValueError, r"w must have the shape of r"),
    (lambda: _changed("k", "fp32"), TypeError, r"k has dtype torch\.float32 but r has"),
    (lambda: _changed("v", "fp64"), TypeError, r"v has dtype torch\.float64 but r has"),
    (lambda: _all_but_the_gate("fp8"), TypeError, r"r must be bf16, fp16, fp32 or fp64"),
]


@pytest.mark.parametrize("make,error,message", ERROR_CLASSES)
def test_check_inputs_raises_what_the_detailed_checks_raise(make, error, message):
    """The one-pass check turns every bad input down, and check_inputs then raises the
    detailed checks' error (type and message, naming the argument)."""
    t = make()
    assert not validation._tensors_agree(t, "w", "v")
    with pytest.raises(error, match=rf"^{message}") as detailed:
        validation._check_tensors(t, "w", "v")
    with pytest.raises(error) as raised:
        validation.check_inputs(t, gate="w", value="v", scale=None, initial_state=None,
                                cu_seqlens=None, cu_seqlens_cpu=None)
    assert type(raised.value) is type(detailed.value)
    assert str(raised.value) == str(detailed.value)


@pytest.fixture
def no_op_runs(monkeypatch):
    """Validation must fail before any op or kernel runs."""
    def boom(*args, **kwargs):
        raise AssertionError("an op ran before validation rejected the input")
    for name in ("recurrent_fwd", "decode_pool"):
        monkeypatch.setattr(torch.ops.dplr, name, boom)


def _entries():
    def fused(t):
        return torch_dplr.fused_recurrent_rwkv7(*(t[n] for n in "r w k v a b".split()))

    def fused_mul(t):
        return torch_dplr.fused_mul_recurrent_rwkv7(t["r"], t["w"], t["k"], t["v"], t["a"],
                                                    t["b"])

    def pool(t):
        return torch_dplr.rwkv7_decode(*(t[n] for n in "r w k v a b".split()),
                                       torch.zeros(4, H, K, K), _slots(0, 1), check_values=False)
    def dplr(t):
        return torch_dplr.fused_recurrent_dplr_delta_rule(*(t[n] for n in "r k v a b w".split()))

    return dict(fused_recurrent_rwkv7=fused, fused_mul_recurrent_rwkv7=fused_mul,
                fused_recurrent_dplr_delta_rule=dplr, rwkv7_decode=pool)


@pytest.mark.parametrize("entry", list(_entries()))
@pytest.mark.parametrize("name,how,error", [
    ("k", "shape", ValueError), ("v", "3d", ValueError), ("w", "heads", ValueError),
    ("a", "fp64", TypeError), ("b", "int", TypeError), ("w", "int", TypeError),
    ("r", "3d", ValueError), ("k", "meta", ValueError), ("v", "list", TypeError),
    ("w", "none", TypeError),
])
def test_bad_input_raises_naming_the_argument(no_op_runs, entry, name, how, error):
    t = _changed(name, how)
    renamed = {"fused_mul_recurrent_rwkv7": {"a": "kk", "b": "a"},  # kk, the learning rate
               "fused_recurrent_dplr_delta_rule": {"r": "q", "w": "gk"}}
    shown = renamed.get(entry, {}).get(name, name)
    with torch.no_grad(), pytest.raises(error, match=rf"^{shown} "):
        _entries()[entry](t)


def test_pool_checks_still_fire_before_the_op(no_op_runs):
    t = _valid()
    args = [t[n] for n in "r w k v a b".split()]
    with torch.no_grad():
        with pytest.raises(TypeError, match="slot_indices must be int32"):
            torch_dplr.rwkv7_decode(*args, torch.zeros(4, H, K, K), _slots(0, 1).long())
        with pytest.raises(ValueError, match="slot_indices must lie in"):
            torch_dplr.rwkv7_decode(*args, torch.zeros(4, H, K, K), _slots(0, 4))
        with pytest.raises(TypeError, match="state_pool must be torch.float32"):
            torch_dplr.rwkv7_decode(*args, torch.zeros(4, H, K, K).double(), _slots(0, 1))
    with pytest.raises(ValueError, match="r requires grad"):
        torch_dplr.rwkv7_decode(t["r"].clone().requires_grad_(), *args[1:],
                                torch.zeros(4, H, K, K), _slots(0, 1))


# ---- the harness ------------------------------------------------------------------------

def test_host_sim_decode_runs():
    pytest.importorskip("triton")
    path = pathlib.Path(__file__).parents[1] / "tools" / "host_sim.py"
    spec = importlib.util.spec_from_file_location("host_sim", path)
    host_sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_sim)
    (rec,) = host_sim.decode_records(batches=(2,), head_dims=(16,), heads=2, blocks=1, calls=2)
    entries = ("fused_recurrent_rwkv7", "fused_mul_recurrent_rwkv7",
               "fused_recurrent_dplr_delta_rule", "rwkv7_decode")
    assert rec["B"] == 2 and all(rec[name] > 0 for name in entries)
    # the harness gave the bodies back
    from torch._library.custom_ops import OPDEFS
    opdef = OPDEFS["dplr::decode_pool"]
    assert opdef._backend_fns[None] is not opdef._backend_fns["cuda"]
