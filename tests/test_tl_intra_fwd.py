"""GPU parity of the TileLang intra-chunk forward kernel (csrc_tl/intra_fwd.py) against its
PyTorch stage, ``chunk_intra_fwd_reference``, output by output.

The kernel is called directly (no torch_dplr dispatch) in its one form, a list of sequences:
rect inputs [B, T, ...] go in flattened to [1, B*T, ...] with the tables of
``kernel_tables``, and the outputs are viewed back as [B, ...] and compared with the
reference run on the original rect / varlen inputs. Every variant is built through
csrc_tl.compile.build, so a disk cache filled by the precompile step answers without nvcc.
Metric: RMS(out - ref) / RMS(ref) per output, plus finiteness of every output. The
reference rounds its dtype outputs once too, so the bars sit a few times above the
observed one-rounding disagreement (dtype outputs) and tf32 products (fp32 matrices).
"""
import itertools
import math

import pytest
import torch

pytestmark = pytest.mark.cuda

pytest.importorskip("tilelang")

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import intra_fwd as kmod  # noqa: E402
from torch_dplr.ops.intra import chunk_intra_fwd_reference  # noqa: E402
from torch_dplr.ops.shapes import allocate, intra_fwd_shapes  # noqa: E402
from torch_dplr.ops.varlen import as_one_sequence_list, kernel_tables  # noqa: E402
from torch_dplr.testing import RWKV7_BOUND, make_inputs, rms_ratio  # noqa: E402

NAMES = ("gl", "A_qk", "A_qb", "A_ak", "A_ab", "qg", "kg", "ag", "bg")
#: RMS(err)/RMS(ref) bars: gl (fp32 cumsum), dtype outputs, fp32 matrices (tf32 products).
TOL = {
    torch.bfloat16: {"gl": 1e-5, "dtype": 6e-3, "fp32": 2e-3},
    torch.float16: {"gl": 1e-5, "dtype": 2.5e-3, "fp32": 1.5e-3},
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _bound(gates):
    return None if gates == "unbounded" else RWKV7_BOUND


def run_kernel(q, k, a, b, gk, cu_seqlens, scale, chunk_size, scheme, redo=False, outs=None):
    """Allocate the outputs as the op does (or take ``outs``), launch the kernel on the
    flattened sequence list; returns the 9 outputs in the op's shapes. New outputs start as
    NaN: an unwritten entry fails. ``scheme="checked"``: the centred kernel, then the tiled
    one's redo form over its outputs, as the op runs them without a licensing bound."""
    if scheme == "checked":
        args = (q, k, a, b, gk, cu_seqlens, scale, chunk_size)
        return run_kernel(*args, "tiled", redo=True, outs=run_kernel(*args, "centred"))
    B, T = q.shape[:2]
    if outs is None:
        specs = intra_fwd_shapes(q, gk, cu_seqlens, chunk_size)
        outs = [x.fill_(math.nan) for x in allocate(specs, q.device)]
    kernel = tlc.build(kmod.intra_fwd_kernel, C=chunk_size, K=q.shape[-1], dtype=q.dtype,
                       scheme=scheme, gate_dtype=gk.dtype, redo=redo)
    tables = kernel_tables(cu_seqlens, B, T, chunk_size, q.device)
    # contiguous outputs: the [1, B*L, ...] forms are views, the kernel writes into outs
    kernel(*map(as_one_sequence_list, (q, k, a, b, gk)), tables.chunk_start, tables.chunk_len,
           float(scale), *map(as_one_sequence_list, outs))
    return outs


def check(B, T, H, K, dtype, gates, chunk_size, scheme, cu=None, gate_dtype=None, seed=0, scale=None):
    inp = make_inputs(B, T, H, K, dtype=dtype, gates=gates, seed=seed, device="cuda")
    q, k, a, b, gk = (inp[n] for n in ("q", "k", "a", "b", "gk"))
    if gate_dtype is not None:
        gk = gk.to(gate_dtype)
    cu_seqlens = torch.tensor(cu if cu is not None else [], dtype=torch.int32, device="cuda")
    scale = K ** -0.5 if scale is None else scale
    lb = _bound(gates)
    got = run_kernel(q, k, a, b, gk, cu_seqlens, scale, chunk_size, scheme)
    ref = chunk_intra_fwd_reference(q, k, a, b, gk, cu_seqlens, scale, chunk_size,
                                    -math.inf if lb is None else lb)
    torch.cuda.synchronize()
    tol = TOL[dtype]
    errors, bad = {}, []
    for name, g, r in zip(NAMES, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        if not torch.isfinite(g).all():
            bad.append(f"{name}: non-finite")
            continue
        err = rms_ratio(g, r)
        errors[name] = err
        bar = tol["gl"] if name == "gl" else tol["fp32"] if g.dtype == torch.float32 else tol["dtype"]
        if not err <= bar:
            bad.append(f"{name}: {err:.2e} > {bar:.0e}")
    assert not bad, f"{bad} (all: { {n: f'{e:.1e}' for n, e in errors.items()} })"
    return errors


def _schemes(chunk_size, gates):
    """The tiled scheme is exact for every gate, and so is the centred one followed by the
    exact redo; the centred one alone only where the bound allows."""
    out = ["tiled", "checked"]
    if kmod.centred_is_safe(chunk_size, _bound(gates)):
        out.append("centred")
    return out


# Small odd sizes: every compiled variant (C x K x dtype x scheme x gate dtype), rect and
# varlen. Varlen: a 1-token sequence, an empty one, partial chunks, a long one.
_CU = [0, 1, 1, 150, 151, 400, 437]
_GATES = {"centred": "rwkv7", "tiled": "unbounded"}


def _variant_id(cfg):
    return "C{C}-K{K}-{dtype}-{scheme}-gk_{gate_dtype}".format(**cfg)


@pytest.mark.parametrize("layout", ["rect", "varlen"])
@pytest.mark.parametrize("cfg", [c for c in kmod.variants() if not c.get("redo")], ids=_variant_id)
def test_small_odd(cfg, layout):
    dt = DTYPES[cfg["dtype"]]
    gate_dtype = None if cfg["gate_dtype"] == "float32" else dt
    args = (cfg["K"], dt, _GATES[cfg["scheme"]], cfg["C"], cfg["scheme"])
    if layout == "varlen":
        check(1, _CU[-1], 3, *args, cu=_CU, gate_dtype=gate_dtype, seed=1)
    else:
        check(2, 237, 3, *args, gate_dtype=gate_dtype, seed=2)


@pytest.mark.parametrize("C", [16, 64])
def test_redo_recomputes_only_chunks_that_broke_the_bound(C):
    """The centred kernel, then the redo kernel over its outputs (as ops/intra.py runs them):
    every (chunk, head) whose gates broke the bound holds the tiled kernel's outputs, bit for
    bit; every other one what the centred kernel wrote."""
    inp = make_inputs(2, 300, 4, 64, dtype=torch.bfloat16, gates="rwkv7", seed=C, device="cuda")
    q, k, a, b, gk = (inp[n] for n in ("q", "k", "a", "b", "gk"))
    gk = gk.clone()
    gk[0, C + 3, 1, 5] = -1e4  # sequence 0, chunk 1, head 1
    gk[0, 3 * C + 1, 1, 9] = -1e4  # sequence 0, chunk 3, head 1: the same redo CTA as chunk 1
    gk[1, 299, 2, 7] = -1e4  # sequence 1, last (partial) chunk, head 2
    cu = torch.tensor([], dtype=torch.int32, device="cuda")
    args = (q, k, a, b, gk, cu, 64 ** -0.5, C)
    assert kmod.centred_is_safe(C, RWKV7_BOUND)
    centred = run_kernel(*args, "centred")
    tiled = run_kernel(*args, "tiled")
    redone = run_kernel(*args, "tiled", redo=True, outs=[x.clone() for x in centred])
    broke = (centred[0] < -kmod.centred_max_decay()).any(-1)  # [B, chunks, H]
    assert 0 < int(broke.sum()) < broke.numel(), "the test needs chunks of both kinds"
    per_token = broke.repeat_interleave(C, dim=1)[:, :300, :, None]
    for name, got, t, c in zip(NAMES, redone, tiled, centred):
        assert torch.isfinite(got).all(), f"{name}: non-finite entries left"
        where = broke[..., None] if name == "gl" else per_token
        assert torch.equal(got, torch.where(where, t, c)), name


@pytest.mark.parametrize("gates", ["rwkv7", "saturated", "unbounded"])
@pytest.mark.parametrize("C", [16, 32, 64])
def test_real_size_bf16(C, gates):
    for scheme in _schemes(C, gates):
        check(1, 2048, 16, 128, torch.bfloat16, gates, C, scheme, seed=3)


@pytest.mark.parametrize("gates", ["rwkv7", "saturated", "unbounded"])
def test_real_size_fp16_k64(gates):
    for scheme in _schemes(64, gates):
        check(1, 2048, 16, 64, torch.float16, gates, 64, scheme, seed=4)


@pytest.mark.parametrize("scheme,gates", [("centred", "rwkv7"), ("tiled", "unbounded")])
def test_large_batch(scheme, gates):
    check(2, 4096, 32, 128, torch.bfloat16, gates, 64, scheme, seed=5)


@pytest.mark.parametrize("scheme,gates", [("centred", "saturated"), ("tiled", "unbounded")])
def test_varlen_real_size(scheme, gates):
    cu = [0, 1, 1, 700, 701, 2048, 4000]
    check(1, cu[-1], 16, 128, torch.bfloat16, gates, 64, scheme, cu=cu, seed=6)


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
def test_gates_in_input_dtype(dt):
    for scheme in ("centred", "tiled"):
        check(1, 1000, 8, 64, DTYPES[dt], "rwkv7", 32, scheme, gate_dtype=DTYPES[dt], seed=7, scale=1.0)


def test_variants_cover_every_dispatch_config():
    """The dispatch builds C x K x dtype x scheme x gate dtype (fp32 or the input dtype);
    the compile test and the precompiled cache cover exactly variants(), which therefore
    holds every config the tests here run too."""
    listed = {(v["C"], v["K"], v["dtype"], v["scheme"], v["gate_dtype"]) for v in kmod.variants()}
    expected = {(C, K, dt, scheme, gate)
                for C, K, dt, scheme in itertools.product(kmod.CHUNK_SIZES, kmod.HEAD_DIMS,
                                                          kmod.DTYPES, kmod.SCHEMES)
                for gate in ("float32", dt)}
    assert listed == expected and len(listed) == 48


def test_scheme_selection():
    assert kmod.scheme_for(64, RWKV7_BOUND) == "centred"
    assert kmod.scheme_for(64, None) == "tiled"
    assert kmod.scheme_for(64, -math.inf) == "tiled"
    assert kmod.scheme_for(64, -5.0) == "tiled"
    assert kmod.scheme_for(16, -5.0) == "centred"
