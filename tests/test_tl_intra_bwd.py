"""GPU parity of the TileLang intra-chunk backward (csrc_tl/intra_bwd.py) with its PyTorch stage.

The kernel is called directly (no dispatch through torch_dplr's ops) in its one form, a list
of sequences: rect inputs [B, T, ...] (and dgl [B, slots, ...]) go in flattened to
[1, B*T, ...] with the tables of ``kernel_tables``, and the outputs, viewed back as [B, ...],
are compared with the reference run on the original rect / varlen inputs. Inputs come from
``make_inputs``; the gradients it consumes come from the PyTorch reference stages
(intra/WY/state forward, state/WY backward) at the real sizes, and are random with garbage
in the masked upper triangles of dA_* in the all-variant sweep (the kernel must ignore them).
Every output is compared with ``chunk_intra_bwd_reference`` by RMS(err)/RMS(ref), and must be
finite; outputs start as NaN, so a row the kernel forgets to write fails too.
Kernels come from the TileLang disk cache when it was filled beforehand (precompile).
"""
import itertools
import math

import pytest
import torch

pytestmark = pytest.mark.cuda
tilelang = pytest.importorskip("tilelang")

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl.intra_bwd import intra_bwd_kernel, select_scheme, variants  # noqa: E402
from torch_dplr.ops.intra import chunk_intra_bwd_reference, chunk_intra_fwd_reference  # noqa: E402
from torch_dplr.ops.state import chunk_state_bwd_reference, chunk_state_fwd_reference  # noqa: E402
from torch_dplr.ops.varlen import as_one_sequence_list, kernel_tables  # noqa: E402
from torch_dplr.ops.wy import chunk_wy_bwd_reference, chunk_wy_fwd_reference  # noqa: E402
from torch_dplr.testing import RWKV7_BOUND, make_inputs  # noqa: E402

DEVICE = "cuda"
# RMS(err)/RMS(ref) bars per input dtype (the library's gradient bars, DESIGN.md section 5).
TOL = {torch.bfloat16: 8e-3, torch.float16: 2e-3}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
OUT_NAMES = ("dq", "dk", "da", "db", "dgk")
GRAD_NAMES = ("dgl", "dA_qk", "dA_qb", "dA_ak", "dA_ab", "dqg", "dkg", "dag", "dbg")
# cu_seqlens with a 1-token sequence, an empty one and a long one (T = 300)
VARLEN_CU = [0, 1, 1, 138, 300]


def _cu(cu):
    if cu is None:
        return torch.empty(0, dtype=torch.int64, device=DEVICE)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


def _inputs(B, T, H, K, dtype, gates, cu, seed, gate_scale=1.0):
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(B, T, H, K, dtype=dtype, gates=gates, seed=seed, device=DEVICE, num_states=N)
    inp["gk"] = inp["gk"] * gate_scale
    return inp


def _pipeline_grads(inp, C, cu, scale, seed):
    """Gradients of the intra outputs from the PyTorch reference stages (o, final state -> intra)."""
    q, k, v, a, b, gk, h0 = (inp[n] for n in ("q", "k", "v", "a", "b", "gk", "initial_state"))
    gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = chunk_intra_fwd_reference(
        q, k, a, b, gk, cu, scale, C, float("-inf"))
    A_inv, w, u = chunk_wy_fwd_reference(A_ab, A_ak, ag, v, cu, C)
    o, ht, h, v_new = chunk_state_fwd_reference(qg, kg, bg, w, u, v, A_qk, A_qb, gl, h0, cu, C, True, True)
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=gen, device=DEVICE).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen, device=DEVICE)
    dqg, dkg, dbg, dw, du, _, dA_qk, dA_qb, dgl, _ = chunk_state_bwd_reference(
        qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, do, dht, h0, cu, C, True, True)
    dA_ab, dA_ak, dag, _ = chunk_wy_bwd_reference(A_inv, A_ak, ag, v, dw, du, cu, C)
    return dict(dgl=dgl, dA_qk=dA_qk, dA_qb=dA_qb, dA_ak=dA_ak, dA_ab=dA_ab,
                dqg=dqg, dkg=dkg, dag=dag, dbg=dbg)


def _random_grads(inp, C, cu, seed):
    """Random gradients; the masked upper parts of dA_* hold large garbage the kernel must ignore."""
    q = inp["q"]
    B, T, H, K = q.shape
    N = None if cu.numel() == 0 else cu.numel() - 1
    slots = -(-T // C) + (0 if N is None else N - 1)
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 2)

    def rnd(shape, dtype):
        return torch.randn(shape, generator=gen, device=DEVICE).to(dtype)

    g = {"dgl": rnd((B, slots, H, K), torch.float32)}
    # position of each token in its chunk, to find the masked (upper) part of each dA row
    if N is None:
        pos = torch.arange(T, device=DEVICE) % C
    else:
        starts = torch.repeat_interleave(cu[:-1].long(), (cu[1:] - cu[:-1]).long())
        pos = (torch.arange(T, device=DEVICE) - starts) % C
    col = torch.arange(C, device=DEVICE)
    upper_incl = (col[None, :] > pos[:, None])[None, :, None, :]   # j > i: masked for qk, qb
    upper_strict = (col[None, :] >= pos[:, None])[None, :, None, :]  # j >= i: masked for ak, ab
    for name, dtype, mask in (("dA_qk", q.dtype, upper_incl), ("dA_qb", q.dtype, upper_incl),
                              ("dA_ak", torch.float32, upper_strict), ("dA_ab", torch.float32, upper_strict)):
        x = rnd((B, T, H, C), torch.float32)
        g[name] = torch.where(mask, 1e4 * x, x).to(dtype)
    for name in ("dqg", "dkg", "dag", "dbg"):
        g[name] = rnd((B, T, H, K), q.dtype)
    return g


def _rms_ratio(out, ref):
    """RMS(out - ref) / RMS(ref) in fp64 on the tensors' device (testing.rms_ratio, no host copy)."""
    out, ref = out.double(), ref.double()
    denom = ref.pow(2).mean().sqrt().item()
    err = (out - ref).pow(2).mean().sqrt().item()
    return err / denom if denom > 0 else err


def _run_kernel(cfg, inp, grads, cu, scale, gl, outs=None):
    """Launch on the flattened sequence list; returns (dq, dk, da, db, dgk) in the inputs' shapes
    (written into ``outs`` when given, else into NaN-filled new tensors)."""
    kern = tlc.build(intra_bwd_kernel, **cfg)
    q, k, a, b, gk = (inp[n] for n in ("q", "k", "a", "b", "gk"))
    B, T = q.shape[:2]
    tables = kernel_tables(cu, B, T, cfg["C"], q.device)
    if outs is None:
        outs = [torch.full(x.shape, math.nan, dtype=x.dtype, device=x.device) for x in (q, k, a, b, gk)]
    inputs = (q, k, a, b, gk, gl, *(grads[n] for n in GRAD_NAMES))
    # contiguous outputs: the [1, B*L, ...] forms are views, the kernel writes into outs
    kern(*map(as_one_sequence_list, inputs), tables.chunk_start, tables.chunk_len, float(scale),
         *map(as_one_sequence_list, outs))
    return outs


def _gl(inp, cu, scale, C):
    q, k, a, b, gk = (inp[n] for n in ("q", "k", "a", "b", "gk"))
    return chunk_intra_fwd_reference(q, k, a, b, gk, cu, scale, C, float("-inf"))[0]


def _check(cfg, inp, grads, cu, scale, dtype, checked=False):
    """``checked``: the bounded kernel, then the exact one's redo form over its outputs, as the
    op runs them without a licensing bound (``cfg`` names the bounded kernel)."""
    q, k, a, b, gk = (inp[n] for n in ("q", "k", "a", "b", "gk"))
    gl = _gl(inp, cu, scale, cfg["C"])
    outs = _run_kernel(cfg, inp, grads, cu, scale, gl)
    if checked:
        outs = _run_kernel(dict(cfg, bounded=False, redo=True), inp, grads, cu, scale, gl, outs)
    ref = chunk_intra_bwd_reference(q, k, a, b, gk, cu, gl, *(grads[n] for n in GRAD_NAMES),
                                    scale, cfg["C"], float("-inf"))
    errors = {}
    for name, out, r in zip(OUT_NAMES, outs, ref):
        assert out.dtype == r.dtype and out.shape == r.shape, name
        assert torch.isfinite(out).all(), f"{name}: non-finite (or unwritten) entries for {cfg}"
        errors[name] = _rms_ratio(out, r)
    bad = {n: e for n, e in errors.items() if not e <= TOL[dtype]}
    assert not bad, f"{cfg}: RMS(err)/RMS(ref) over {TOL[dtype]}: {bad} (all: {errors})"
    return errors


def _gates_for(cfg):
    """(gate style, gate scale, lower bound) the config is meant for: bounded configs get gates
    whose declared bound licenses the scheme (RWKV-7's, scaled down where fp16 needs it)."""
    if not cfg["bounded"]:
        return "unbounded", 1.0, None
    for s in (1.0, 0.25):
        if select_scheme(cfg["C"], cfg["dtype"], RWKV7_BOUND * s):
            return "rwkv7", s, RWKV7_BOUND * s
    raise AssertionError(f"no test gate for {cfg}")


def _id(cfg):
    return "C{C}-K{K}-{dtype}-{s}-gk_{gk_dtype}".format(s="bnd" if cfg["bounded"] else "unb", **cfg)


@pytest.mark.parametrize("layout", ["rect", "varlen"])
@pytest.mark.parametrize("cfg", [c for c in variants() if not c.get("redo")], ids=_id)
def test_variant_small(cfg, layout):
    """Every compiled variant at odd sizes, rect and varlen: T not a multiple of C, varlen with
    1-token, empty and long sequences; random gradients with garbage in the masked dA parts."""
    dtype = DTYPES[cfg["dtype"]]
    gates, gscale, _ = _gates_for(cfg)
    varlen = layout == "varlen"
    cu_list = VARLEN_CU if varlen else None
    B, T = (1, VARLEN_CU[-1]) if varlen else (2, 157)
    inp = _inputs(B, T, 3, cfg["K"], dtype, gates, cu_list, seed=cfg["C"] + cfg["K"], gate_scale=gscale)
    if cfg["gk_dtype"] != "float32":
        inp["gk"] = inp["gk"].to(dtype)
    cu = _cu(cu_list)
    grads = _random_grads(inp, cfg["C"], cu, seed=7)
    _check(cfg, inp, grads, cu, cfg["K"] ** -0.5, dtype)


REAL = [  # (C, gate style, scheme: bounded, unbounded or checked = bounded + exact redo)
    (64, "rwkv7", "bnd"), (64, "unbounded", "unb"), (64, "saturated", "unb"),
    (64, "unbounded", "checked"),
    (32, "saturated", "bnd"), (32, "unbounded", "unb"), (32, "unbounded", "checked"),
    (16, "rwkv7", "bnd"), (16, "unbounded", "unb"), (16, "unbounded", "checked"),
]


@pytest.mark.parametrize("C,gates,scheme", REAL, ids=[f"C{c}-{g}-{s}" for c, g, s in REAL])
def test_real_size_pipeline_grads(C, gates, scheme):
    """B=1 T=2048 H=16 K=128 bf16, gradients from the reference pipeline, RWKV-7 scale 1."""
    if scheme == "bnd":
        assert select_scheme(C, "bfloat16", RWKV7_BOUND)
    inp = _inputs(1, 2048, 16, 128, torch.bfloat16, gates, None, seed=C)
    cu = _cu(None)
    grads = _pipeline_grads(inp, C, cu, 1.0, seed=C)
    cfg = dict(C=C, K=128, dtype="bfloat16", gk_dtype="float32", bounded=scheme != "unb")
    _check(cfg, inp, grads, cu, 1.0, torch.bfloat16, checked=scheme == "checked")


@pytest.mark.parametrize("bounded", [True, False], ids=["bnd", "unb"])
def test_large_batch(bounded):
    """B=2 T=4096 H=32 K=128 bf16, C=64 (random gradients: the pipeline oracle is slow here)."""
    inp = _inputs(2, 4096, 32, 128, torch.bfloat16, "rwkv7" if bounded else "unbounded", None, seed=11)
    cu = _cu(None)
    grads = _random_grads(inp, 64, cu, seed=11)
    cfg = dict(C=64, K=128, dtype="bfloat16", gk_dtype="float32", bounded=bounded)
    _check(cfg, inp, grads, cu, 128 ** -0.5, torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_varlen_pipeline_grads(dtype):
    """Varlen at a real size with reference-pipeline gradients, both schemes, K=64."""
    cu_list = [0, 1, 1, 700, 701, 2048]
    torch_dtype = DTYPES[dtype]
    cu = _cu(cu_list)
    for gates, bounded in (("rwkv7", select_scheme(32, dtype, RWKV7_BOUND)), ("unbounded", False)):
        inp = _inputs(1, 2048, 16, 64, torch_dtype, gates, cu_list, seed=5)
        grads = _pipeline_grads(inp, 32, cu, 64 ** -0.5, seed=5)
        cfg = dict(C=32, K=64, dtype=dtype, gk_dtype="float32", bounded=bounded)
        _check(cfg, inp, grads, cu, 64 ** -0.5, torch_dtype)


def test_extreme_unbounded_gates_finite():
    """Gates of -40 per step (cumsums of thousands of e-folds): exact scheme stays finite."""
    inp = _inputs(1, 256, 4, 64, torch.bfloat16, "unbounded", None, seed=3)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    hit = torch.rand(inp["gk"].shape, generator=gen, device=DEVICE) < 0.3
    inp["gk"] = torch.where(hit, torch.full_like(inp["gk"], -40.0), inp["gk"])
    cu = _cu(None)
    grads = _random_grads(inp, 64, cu, seed=3)
    cfg = dict(C=64, K=64, dtype="bfloat16", gk_dtype="float32", bounded=False)
    _check(cfg, inp, grads, cu, 1.0, torch.bfloat16)


def test_variants_cover_every_dispatch_config():
    """The dispatch builds C x K x dtype x scheme x gate dtype (fp32 or the input dtype); the
    compile test and the precompiled cache cover exactly variants(), so the configs the tests
    here run (all defaults, fp32 or input-dtype gates) are in it."""
    listed = {(v["C"], v["K"], v["dtype"], v["bounded"], v["gk_dtype"]) for v in variants()}
    expected = {(C, K, dt, bounded, gk)
                for C, K, dt, bounded in itertools.product((16, 32, 64), (64, 128),
                                                           ("bfloat16", "float16"), (True, False))
                for gk in ("float32", dt)}
    assert listed == expected and len(listed) == 48


def test_select_scheme():
    assert select_scheme(64, "bfloat16", RWKV7_BOUND)
    assert not select_scheme(64, "float16", RWKV7_BOUND)
    assert select_scheme(16, "float16", RWKV7_BOUND)
    assert not select_scheme(64, "bfloat16", None)
    assert not select_scheme(64, "bfloat16", -math.inf)
    assert not select_scheme(64, "bfloat16", -5.0) and select_scheme(16, "bfloat16", -5.0)


def _differing_units(got, want, broke, C):
    """(sequence, chunk, head, broke the bound, max |difference|) of every unit that differs."""
    diff = (got.float() - want.float()).abs()
    rows = torch.nn.functional.pad(diff, (0, 0, 0, 0, 0, -diff.shape[1] % C))
    per_unit = rows.unflatten(1, (-1, C)).amax(dim=(2, 4))  # [B, chunks, H]
    return [(b, c, h, bool(broke[b, c, h]), float(per_unit[b, c, h]))
            for b, c, h in (per_unit > 0).nonzero().tolist()]


@pytest.mark.parametrize("C", [16, 64])
def test_redo_recomputes_only_chunks_that_broke_the_bound(C):
    """The bounded kernel, then the redo kernel over its outputs (as ops/intra.py runs them):
    every (chunk, head) whose gates broke the bound holds the unbounded kernel's gradients
    (dq, dk, da, db bit for bit; dgk, the serial sums of per-row terms, within a few fp32 ulps
    of its largest value: the redo kernel runs the same body in a loop over the broken chunks
    and its compiled sums round differently, by 2.4e-7 to 4.8e-7 on an H100); every other one
    exactly what the bounded kernel wrote."""
    from csrc_tl.intra_bwd import bounded_max_decay
    inp = _inputs(2, 300, 4, 64, torch.bfloat16, "rwkv7", None, seed=C)
    gk = inp["gk"].clone()
    gk[0, C + 3, 1, 5] = -1e4  # sequence 0, chunk 1, head 1
    gk[0, 3 * C + 1, 1, 9] = -1e4  # sequence 0, chunk 3, head 1: the same redo CTA as chunk 1
    gk[1, 299, 2, 7] = -1e4  # sequence 1, last (partial) chunk, head 2
    inp = {**inp, "gk": gk}
    cu, scale = _cu(None), 64 ** -0.5
    assert select_scheme(C, "bfloat16", RWKV7_BOUND)
    grads = _random_grads(inp, C, cu, seed=1)
    gl = _gl(inp, cu, scale, C)
    base = dict(C=C, K=64, dtype="bfloat16", gk_dtype="float32")
    bounded = _run_kernel(dict(base, bounded=True), inp, grads, cu, scale, gl)
    exact = _run_kernel(dict(base, bounded=False), inp, grads, cu, scale, gl)
    redone = _run_kernel(dict(base, bounded=False, redo=True), inp, grads, cu, scale, gl,
                         outs=[x.clone() for x in bounded])
    broke = (gl < -bounded_max_decay(torch.bfloat16)).any(-1)  # [B, chunks, H]
    assert 0 < int(broke.sum()) < broke.numel(), "the test needs chunks of both kinds"
    per_token = broke.repeat_interleave(C, dim=1)[:, :300, :, None]
    for name, got, e, bnd in zip(OUT_NAMES, redone, exact, bounded):
        assert torch.isfinite(got).all(), f"{name}: non-finite entries left"
        want = torch.where(per_token, e, bnd)
        units = _differing_units(got, want, broke, C)
        bar = 8 * torch.finfo(torch.float32).eps * float(e.abs().max()) if name == "dgk" else 0
        assert all(unit_broke and diff <= bar for *_, unit_broke, diff in units), \
            f"{name}: (sequence, chunk, head, broke, max |redo - expected|) over {bar:.2g}: {units}"
