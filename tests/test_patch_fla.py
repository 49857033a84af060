"""torch_dplr.patch_fla(): FLA's public functions, and every name already bound to them, run
torch_dplr until undone.

FLA's Triton kernels cannot run on a CPU, so FLA is stood in by fake modules in sys.modules
with FLA 0.6.0's module layout and signatures: fake functions that fail if called.  When the
real package imports (``fla`` from flash-linear-attention / fla-core), the last tests patch it.
"""
from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

import torch_dplr
from torch_dplr import fla_patch
from torch_dplr.testing import make_inputs

RWKV7 = "fla.ops.rwkv7"
DPLR = "fla.ops.generalized_delta_rule.dplr"

# FLA 0.6.0's signatures (fla/ops/rwkv7/{chunk,fused_recurrent}.py,
# fla/ops/generalized_delta_rule/dplr/{chunk,fused_recurrent}.py): parameter -> default
_CHUNK_TAIL = dict(initial_state=None, output_final_state=False, cu_seqlens=None,
                   cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                   disable_recompute=False, cp_context=None, lower_bound=None)
FLA_SIGNATURES = {
    "chunk_rwkv7": (("r", "w", "k", "v", "a", "b"), dict(scale=1.0, **_CHUNK_TAIL)),
    "chunk_dplr_delta_rule": (("q", "k", "v", "a", "b", "gk"),
                              dict(scale=None, **_CHUNK_TAIL, kwargs="**")),
    "fused_recurrent_rwkv7": (("r", "w", "k", "v", "a", "b"),
                              dict(scale=None, initial_state=None, output_final_state=True,
                                   cu_seqlens=None)),
    "fused_mul_recurrent_rwkv7": (("r", "w", "k", "v", "kk", "a"),
                                  dict(scale=1.0, initial_state=None, output_final_state=False,
                                       reverse=False, cu_seqlens=None)),
    "fused_recurrent_dplr_delta_rule": (("q", "k", "v", "a", "b", "gk"),
                                        dict(scale=None, initial_state=None,
                                             output_final_state=False, reverse=False,
                                             cu_seqlens=None)),
}


def _signature_of(fn):
    params = list(inspect.signature(fn).parameters.values())
    positional = tuple(p.name for p in params if p.default is inspect.Parameter.empty
                       and p.kind is not inspect.Parameter.VAR_KEYWORD)
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    defaults.update({p.name: "**" for p in params if p.kind is inspect.Parameter.VAR_KEYWORD})
    return positional, defaults


def _fake_function(name):
    def fake(*args, **kwargs):
        raise AssertionError(f"FLA's {name} ran: the call was not routed to torch_dplr")
    fake.__name__ = name
    return fake


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def fake_fla(monkeypatch):
    """FLA's layout: defining modules, the re-exporting packages, fla.layers.rwkv7 (which
    binds chunk_rwkv7 and fused_mul_recurrent_rwkv7 and calls them through its globals) and a
    user module that imported chunk_rwkv7 under another name."""
    monkeypatch.setattr(fla_patch, "_active", None)
    fns = {name: _fake_function(name) for name in FLA_SIGNATURES}
    mods = {
        "fla": _module("fla"),
        "fla.ops": _module("fla.ops", **fns),
        "fla.ops.generalized_delta_rule": _module(
            "fla.ops.generalized_delta_rule", chunk_dplr_delta_rule=fns["chunk_dplr_delta_rule"],
            fused_recurrent_dplr_delta_rule=fns["fused_recurrent_dplr_delta_rule"]),
        DPLR: _module(DPLR, chunk_dplr_delta_rule=fns["chunk_dplr_delta_rule"],
                      fused_recurrent_dplr_delta_rule=fns["fused_recurrent_dplr_delta_rule"]),
        "fla.ops.rwkv7.chunk": _module("fla.ops.rwkv7.chunk", chunk_rwkv7=fns["chunk_rwkv7"],
                                       chunk_dplr_delta_rule=fns["chunk_dplr_delta_rule"]),
        RWKV7: _module(RWKV7, chunk_rwkv7=fns["chunk_rwkv7"],
                       fused_recurrent_rwkv7=fns["fused_recurrent_rwkv7"],
                       fused_mul_recurrent_rwkv7=fns["fused_mul_recurrent_rwkv7"]),
        "fla.layers.rwkv7": _module("fla.layers.rwkv7", chunk_rwkv7=fns["chunk_rwkv7"],
                                    fused_mul_recurrent_rwkv7=fns["fused_mul_recurrent_rwkv7"]),
        "user_model_code": _module("user_model_code", rwkv_attention=fns["chunk_rwkv7"]),
    }
    # how RWKV7Attention.forward calls the two (fla/layers/rwkv7.py, FLA 0.6.0): by keyword
    exec(
        "def attention(r, w, k, v, kk, a, recurrent_state, use_cache, cu_seqlens, training):\n"
        "    if training:\n"
        "        return chunk_rwkv7(r=r, w=w, k=k, v=v, a=-kk, b=kk * a, scale=1.,\n"
        "                           initial_state=recurrent_state, output_final_state=use_cache,\n"
        "                           cu_seqlens=cu_seqlens, safe_gate=True,\n"
        "                           lower_bound=-0.6065306597126334, chunk_size=64)\n"
        "    return fused_mul_recurrent_rwkv7(r=r, w=w, k=k, v=v, kk=kk, a=a, scale=1.,\n"
        "                                     initial_state=recurrent_state,\n"
        "                                     output_final_state=use_cache,\n"
        "                                     cu_seqlens=cu_seqlens)\n",
        mods["fla.layers.rwkv7"].__dict__)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    yield types.SimpleNamespace(fns=fns, mods=mods)
    torch_dplr.unpatch_fla()


def _rwkv7_inputs(B=1, T=20, H=2, K=8, seed=0):
    x = make_inputs(B, T, H, K, seed=seed)
    g = torch.Generator().manual_seed(seed)
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    iclr = torch.sigmoid(torch.randn(B, T, H, K, generator=g))
    return dict(r=x["q"], w=x["gk"], k=x["k"], v=x["v"], kk=kk, a=iclr), x["initial_state"]


def test_every_binding_of_an_fla_function_is_rebound(fake_fla):
    patch = torch_dplr.patch_fla()
    originals = set(map(id, fake_fla.fns.values()))
    for name, mod in fake_fla.mods.items():
        for attr, value in vars(mod).items():
            assert id(value) not in originals, f"{name}.{attr} still binds FLA's function"
    expected = {f"{m}.{n}" for m, mod in fake_fla.mods.items() for n, v in vars(mod).items()
                if id(v) in originals}
    assert set(patch.rebound) >= expected
    assert "user_model_code.rwkv_attention" in patch.rebound
    # FLA's own chunk_rwkv7 calls chunk_dplr_delta_rule through its module: rebound too
    assert sys.modules["fla.ops.rwkv7.chunk"].chunk_dplr_delta_rule is \
        sys.modules[DPLR].chunk_dplr_delta_rule
    assert patch.missing == ()


def test_layer_calls_run_torch_dplr(fake_fla):
    x, h0 = _rwkv7_inputs()
    attention = fake_fla.mods["fla.layers.rwkv7"].attention
    with torch_dplr.patch_fla() as patch:
        o_train, ht_train = attention(**x, recurrent_state=h0, use_cache=True, cu_seqlens=None,
                                      training=True)
        o_dec, ht_dec = attention(**x, recurrent_state=h0, use_cache=True, cu_seqlens=None,
                                  training=False)
    assert patch.calls["chunk_rwkv7"] == 1 and patch.calls["fused_mul_recurrent_rwkv7"] == 1
    a, b = -x["kk"], x["kk"] * x["a"]
    o_ref, ht_ref = torch_dplr.chunk_rwkv7(x["r"], x["w"], x["k"], x["v"], a, b,
                                           initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o_train, o_ref)
    torch.testing.assert_close(ht_train, ht_ref)
    torch.testing.assert_close(o_dec, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ht_dec, ht_ref, rtol=1e-4, atol=1e-5)
    # undone on leaving the block: the fake runs (and fails) again
    with pytest.raises(AssertionError, match="not routed"):
        attention(**x, recurrent_state=h0, use_cache=True, cu_seqlens=None, training=True)


def test_undo_restores_exactly(fake_fla, monkeypatch):
    before = {name: dict(vars(mod)) for name, mod in fake_fla.mods.items()}
    patch = torch_dplr.patch_fla()
    # imported while patched: binds the adapter, which undo must turn back into FLA's function
    late = _module("late_import", f=sys.modules[RWKV7].chunk_rwkv7)
    monkeypatch.setitem(sys.modules, "late_import", late)
    # rebound by someone else meanwhile: undo leaves it alone
    replacement = lambda *a, **k: None  # noqa: E731
    sys.modules["fla.layers.rwkv7"].fused_mul_recurrent_rwkv7 = replacement
    patch.undo()
    assert not patch.active
    for name, mod in fake_fla.mods.items():
        for attr, value in before[name].items():
            if (name, attr) == ("fla.layers.rwkv7", "fused_mul_recurrent_rwkv7"):
                assert vars(mod)[attr] is replacement
            else:
                assert vars(mod)[attr] is value, f"{name}.{attr} not restored"
    assert late.f is fake_fla.fns["chunk_rwkv7"]
    patch.undo()  # idempotent
    assert torch_dplr.unpatch_fla() is False


def test_nested_patch_owns_nothing_and_unpatch_undoes(fake_fla):
    outer = torch_dplr.patch_fla()
    with torch_dplr.patch_fla() as inner:
        assert inner.rebound == ()
    assert sys.modules[RWKV7].chunk_rwkv7 is not fake_fla.fns["chunk_rwkv7"]
    assert torch_dplr.unpatch_fla() is True
    assert not outer.active
    assert sys.modules[RWKV7].chunk_rwkv7 is fake_fla.fns["chunk_rwkv7"]


def test_adapters_have_fla_signatures(fake_fla):
    with torch_dplr.patch_fla():
        for name, expected in FLA_SIGNATURES.items():
            path = RWKV7 if "rwkv7" in name else DPLR
            assert _signature_of(getattr(sys.modules[path], name)) == expected, name


def test_fla_defaults_are_kept(fake_fla):
    """FLA's fused_recurrent_rwkv7 defaults to scale=None (K ** -0.5) and to returning the
    final state; its fused_mul form to scale=1 and no final state."""
    x, h0 = _rwkv7_inputs(T=5)
    a, b = -x["kk"], x["kk"] * x["a"]
    with torch_dplr.patch_fla():
        o, ht = sys.modules[RWKV7].fused_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], a, b)
        o_mul, ht_mul = sys.modules[RWKV7].fused_mul_recurrent_rwkv7(**x)
    K = x["r"].shape[-1]
    o_ref, ht_ref = torch_dplr.fused_recurrent_dplr_delta_rule(
        x["r"], x["k"], x["v"], a, b, x["w"], scale=K ** -0.5, output_final_state=True)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(ht, ht_ref)
    o_one, _ = torch_dplr.fused_recurrent_dplr_delta_rule(x["r"], x["k"], x["v"], a, b, x["w"],
                                                          scale=1.0)
    torch.testing.assert_close(o_mul, o_one, rtol=1e-5, atol=1e-6)
    assert ht_mul is None


def test_unhonoured_arguments_raise_naming_them(fake_fla):
    x, _ = _rwkv7_inputs(T=4)
    r, w, k, v = x["r"], x["w"], x["k"], x["v"]
    a, b = -x["kk"], x["kk"] * x["a"]
    with torch_dplr.patch_fla():
        chunk_rwkv7 = sys.modules[RWKV7].chunk_rwkv7
        chunk_dplr = sys.modules[DPLR].chunk_dplr_delta_rule
        # FLA's context parallelism objects are not torch_dplr's (torch_dplr.cp.build_context)
        with pytest.raises(TypeError, match="cp_context"):
            chunk_rwkv7(r, w, k, v, a, b, cp_context=object())
        with pytest.raises(ValueError, match="head_first"):
            chunk_dplr(r, k, v, a, b, w, head_first=True)
        with pytest.raises(TypeError, match="not_an_fla_argument"):
            chunk_dplr(r, k, v, a, b, w, not_an_fla_argument=1)
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_rwkv7(r, w, k, v, a, b, chunk_size=128)
        # accepted and ignored: recompute is a checkpoint policy here
        o, _ = chunk_rwkv7(r, w, k, v, a, b, disable_recompute=True, safe_gate=True)
        assert o.shape == v.shape


def test_compiled_caller_runs_torch_dplr_without_graph_breaks(fake_fla):
    x, h0 = _rwkv7_inputs(T=20)
    attention = fake_fla.mods["fla.layers.rwkv7"].attention
    with torch_dplr.patch_fla() as patch:
        compiled = torch.compile(attention, fullgraph=True, backend="eager")
        o, ht = compiled(**x, recurrent_state=h0, use_cache=True, cu_seqlens=None, training=True)
        compiled(**x, recurrent_state=h0, use_cache=True, cu_seqlens=None, training=True)
    torch._dynamo.reset()
    assert patch.calls["chunk_rwkv7"] == 2  # counted on every call, not once per trace
    o_ref, _ = torch_dplr.chunk_rwkv7(x["r"], x["w"], x["k"], x["v"], -x["kk"],
                                      x["kk"] * x["a"], initial_state=h0)
    torch.testing.assert_close(o, o_ref)


def test_without_fla_the_error_says_so(monkeypatch):
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fla", None)  # the import of fla fails, as when absent
    with pytest.raises(ModuleNotFoundError, match="flash-linear-attention is not installed"):
        torch_dplr.patch_fla()


def test_a_broken_fla_install_is_told_apart(fake_fla, monkeypatch):
    monkeypatch.delitem(sys.modules, RWKV7)
    monkeypatch.setitem(sys.modules, "fla.ops.rwkv7", None)
    with pytest.raises(ImportError, match="is installed but fla.ops.rwkv7 could not be imported"):
        torch_dplr.patch_fla()


# ---- the real package, where it imports on this machine (its ops import without a GPU) ----

def _real_fla():
    try:
        import fla.ops.generalized_delta_rule.dplr  # noqa: F401
        import fla.ops.rwkv7  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (absent, or present without what it needs)
        pytest.skip(f"flash-linear-attention does not import here ({type(exc).__name__})")
    return sys.modules["fla.ops.rwkv7"], sys.modules[DPLR]


def test_real_fla_signatures_match_the_adapters():
    rwkv7, dplr = _real_fla()
    with torch_dplr.patch_fla() as patch:
        for name in FLA_SIGNATURES:
            original = patch._originals[name]
            adapter = getattr(rwkv7 if "rwkv7" in name else dplr, name)
            assert adapter is not original
            assert _signature_of(adapter) == _signature_of(original), name


def test_real_fla_routes_and_restores():
    rwkv7, dplr = _real_fla()
    originals = {n: getattr(rwkv7, n) for n in FLA_SIGNATURES if hasattr(rwkv7, n)}
    fla_chunk_rwkv7 = rwkv7.chunk_rwkv7  # held before the patch: FLA's own function
    x, h0 = _rwkv7_inputs(T=20)
    a, b = -x["kk"], x["kk"] * x["a"]
    with torch_dplr.patch_fla() as patch:
        o, ht = rwkv7.chunk_rwkv7(x["r"], x["w"], x["k"], x["v"], a, b, initial_state=h0,
                                  output_final_state=True)
        # FLA's own chunk_rwkv7 reaches chunk_dplr_delta_rule through its module: rebound
        o_held, _ = fla_chunk_rwkv7(x["r"], x["w"], x["k"], x["v"], a, b, initial_state=h0)
    assert patch.calls["chunk_rwkv7"] == 1 and patch.calls["chunk_dplr_delta_rule"] == 1
    o_ref, ht_ref = torch_dplr.chunk_rwkv7(x["r"], x["w"], x["k"], x["v"], a, b,
                                           initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(ht, ht_ref)
    torch.testing.assert_close(o_held, o_ref)
    for n, fn in originals.items():
        assert getattr(rwkv7, n) is fn
