"""GPU parity of the TileLang WY kernels (csrc_tl/wy_fwd.py, csrc_tl/wy_bwd.py) with their PyTorch
kernels ``torch_dplr.ops.wy.chunk_wy_fwd_reference`` / ``chunk_wy_bwd_reference``.

Both kernels are called directly (no op dispatch) in their one varlen form: a rect batch is
passed as the sequence list of its flattened ``[1, B*T]`` view (``as_one_sequence_list`` +
``kernel_tables``), a varlen batch with its own tables. Inputs are realistic: ``make_inputs``
(RWKV-7 or unbounded gates) through the PyTorch intra stage (A_ab, A_ak, ag) and WY forward
(A_ab_inv, the backward's input); dw, du are seeded normal draws. Metric RMS(err)/RMS(ref) with
a bar per output and dtype, plus finiteness. Outputs are pre-filled with NaN so a row the kernel
fails to write shows up, and a run whose chunk tables leave holes checks that rows outside every
listed chunk stay untouched. Errors are printed (``pytest -rA`` shows them).

Kernels come from TileLang's disk cache when it was filled beforehand
(``TILELANG_CACHE_DIR``); otherwise each config compiles on first use (~20 s).
"""
from __future__ import annotations

import functools

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32_matmul")]

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import wy_bwd as wb  # noqa: E402
from csrc_tl import wy_fwd as wf  # noqa: E402
from torch_dplr.ops.intra import chunk_intra_fwd_reference  # noqa: E402
from torch_dplr.ops.shapes import allocate, wy_bwd_shapes, wy_fwd_shapes  # noqa: E402
from torch_dplr.ops.varlen import as_one_sequence_list, kernel_tables  # noqa: E402
from torch_dplr.ops.wy import chunk_wy_bwd_reference, chunk_wy_fwd_reference  # noqa: E402
from torch_dplr.testing import RWKV7_BOUND, make_inputs, rms_ratio  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16
FWD_NAMES = ("A_ab_inv", "w", "u")
BWD_NAMES = ("dA_ab", "dA_ak", "dag", "dv")

# RMS(err)/RMS(ref) bars. From a CPU emulation of each kernel's roundings (16-bit hi/lo
# splits, fp32 accumulation) against the fp32 reference, T=2048, H=4, every C and K, RWKV-7
# and unbounded gates; the largest value seen, then ~5-10x margin for the GPU's summation
# order:
#   fwd  A_ab_inv 1.1e-7;  w 4.8e-5 bf16 / 5.3e-6 fp16;  u 1.2e-4 / 3.8e-5
#   bwd  dA_ab 5.6e-6;  dA_ak 2.5e-6;  dag 4.5e-5 / 1.0e-5;  dv 1.2e-4 / 3.7e-5
# w, u, dag, dv are rounded to the data dtype by both sides, so their error is rounding flips
# (the rounding itself is 1.7e-3 bf16 / 2.1e-4 fp16); A_ab_inv 1e-5 is also the bar the
# rect kernel passed against fp64 on the H200.
TOL = {
    BF16: dict(A_ab_inv=1e-5, w=5e-4, u=5e-4, dA_ab=5e-5, dA_ak=2.5e-5, dag=5e-4, dv=5e-4),
    FP16: dict(A_ab_inv=1e-5, w=2e-4, u=2e-4, dA_ab=5e-5, dA_ak=2.5e-5, dag=2e-4, dv=2e-4),
}


@functools.lru_cache(maxsize=4)
def stage_inputs(B, T, H, K, C, dtype, gates="rwkv7", cu=None, seed=0):
    """The WY stage's inputs, made by the PyTorch intra stage and WY forward on CUDA."""
    inp = make_inputs(B, T, H, K, dtype=dtype, gates=gates, seed=seed, device="cuda")
    cu_t = (torch.tensor(cu, dtype=torch.int64, device="cuda") if cu is not None
            else torch.empty(0, dtype=torch.int64, device="cuda"))
    bound = float("-inf") if gates == "unbounded" else RWKV7_BOUND
    q, k, v, a, b, gk = (inp[n] for n in ("q", "k", "v", "a", "b", "gk"))
    _, _, _, A_ak, A_ab, _, _, ag, _ = chunk_intra_fwd_reference(q, k, a, b, gk, cu_t, K ** -0.5, C, bound)
    A_inv, w, u = chunk_wy_fwd_reference(A_ab, A_ak, ag, v, cu_t, C)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    dw = torch.randn(w.shape, generator=g, device="cuda").to(dtype)
    du = torch.randn(u.shape, generator=g, device="cuda").to(dtype)
    return dict(A_ab=A_ab, A_ak=A_ak, ag=ag, v=v, A_inv=A_inv, dw=dw, du=du, cu=cu_t, C=C)


def chunk_tables(st):
    """(chunk_start, chunk_len) of the flattened sequence list (rect: B sequences of T)."""
    B, T = st["v"].shape[:2]
    tables = kernel_tables(st["cu"], B, T, st["C"], st["v"].device)
    return tables.chunk_start, tables.chunk_len


def nan_outputs(specs, device):
    outs = allocate(specs, device)
    for x in outs:
        x.fill_(float("nan"))
    return outs


def run_fwd(st, tables=None, **knobs):
    """wy_fwd kernel on ``st`` (outputs NaN-filled first); returns (A_ab_inv, w, u)."""
    ag, v = st["ag"], st["v"]
    kernel = tlc.build(wf.wy_fwd_kernel, C=st["C"], K=ag.shape[-1], V=v.shape[-1], dtype=v.dtype, **knobs)
    outs = nan_outputs(wy_fwd_shapes(st["A_ab"], ag, v), v.device)
    ins = [as_one_sequence_list(st[n]) for n in ("A_ab", "A_ak", "ag", "v")]
    kernel(*ins, *(tables or chunk_tables(st)), *map(as_one_sequence_list, outs))
    torch.cuda.synchronize()
    return outs


def run_bwd(st, tables=None, **knobs):
    """wy_bwd kernel on ``st`` (outputs NaN-filled first); returns (dA_ab, dA_ak, dag, dv)."""
    ag, v = st["ag"], st["v"]
    kernel = tlc.build(wb.wy_bwd_kernel, C=st["C"], K=ag.shape[-1], V=v.shape[-1], dtype=v.dtype, **knobs)
    outs = nan_outputs(wy_bwd_shapes(st["A_inv"], st["A_ak"], ag, v), v.device)
    ins = [as_one_sequence_list(st[n]) for n in ("A_inv", "A_ak", "ag", "v", "dw", "du")]
    kernel(*ins, *(tables or chunk_tables(st)), *map(as_one_sequence_list, outs))
    torch.cuda.synchronize()
    return outs


def ref_fwd(st):
    return chunk_wy_fwd_reference(st["A_ab"], st["A_ak"], st["ag"], st["v"], st["cu"], st["C"])


def ref_bwd(st):
    return chunk_wy_bwd_reference(st["A_inv"], st["A_ak"], st["ag"], st["v"], st["dw"], st["du"],
                                  st["cu"], st["C"])


def compare(name, names, got, ref, dtype, rows=None):
    """Print the errors; assert finiteness and the bars. ``rows``: token mask to compare on."""
    tol = TOL[dtype]
    errs = {}
    for n, g, r in zip(names, got, ref):
        if rows is not None:
            g, r = g[:, rows], r[:, rows]
        assert torch.isfinite(g).all(), f"{name}: {n} has non-finite values (unwritten rows?)"
        errs[n] = rms_ratio(g, r)
    print(f"{name}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    bad = {n: e for n, e in errs.items() if not e <= tol[n]}
    assert not bad, f"{name}: over the bar {bad} (bars {tol})"


def check_both(name, st, **knobs):
    dtype = st["v"].dtype
    compare(f"wy_fwd {name}", FWD_NAMES, run_fwd(st, **knobs.get("fwd", {})), ref_fwd(st), dtype)
    compare(f"wy_bwd {name}", BWD_NAMES, run_bwd(st, **knobs.get("bwd", {})), ref_bwd(st), dtype)


# ---- real sizes, rect (flattened to a sequence list) ----

@pytest.mark.parametrize("gates", ["rwkv7", "unbounded"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("C", [16, 32, 64])
def test_rect_real_size(C, K, dtype, gates):
    st = stage_inputs(2, 2048, 16, K, C, dtype, gates)
    check_both(f"B2 T2048 H16 K{K} C{C} {dtype} gates={gates}", st)


# ---- odd sizes: T not a multiple of C, T shorter than a chunk ----

@pytest.mark.parametrize("T", [1, 37, 1000])
@pytest.mark.parametrize("C", [16, 32, 64])
def test_rect_odd_sizes(T, C):
    st = stage_inputs(3, T, 3, 64, C, BF16)
    check_both(f"B3 T{T} H3 K64 C{C} bf16", st)


# ---- varlen: empty sequences, 1 token, exactly one chunk (16, 32, 64), long ones ----

LENS = (0, 1, 64, 32, 16, 0, 1, 17, 1930, 2039)
CU = tuple(int(x) for x in torch.tensor((0,) + LENS).cumsum(0))  # T = 4100


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("C", [16, 32, 64])
def test_varlen_real_size(C, K, dtype):
    st = stage_inputs(1, CU[-1], 16, K, C, dtype, cu=CU)
    check_both(f"varlen {LENS} H16 K{K} C{C} {dtype}", st)


@pytest.mark.parametrize("C", [16, 32, 64])
def test_varlen_unbounded(C):
    st = stage_inputs(1, CU[-1], 16, 128, C, FP16, "unbounded", cu=CU)
    check_both(f"varlen {LENS} H16 K128 C{C} fp16 gates=unbounded", st)


# ---- rows outside every listed chunk are never written; len-0 slots do nothing ----

HOLE_CU = (0, 1, 1, 300, 301, 1200, 1500)  # 1 token, empty, 299, 1 token, 899, 300


def tables_with_holes(st):
    """Tables of HOLE_CU without its last sequence (tokens 1200..1499 in no chunk) and with
    the slots of sequence 2 (tokens 1..299) set to length 0."""
    cu = torch.tensor(HOLE_CU[:-1], dtype=torch.int32, device="cuda")
    tables = kernel_tables(cu, 1, HOLE_CU[-1], st["C"], cu.device)
    start, length = tables.chunk_start.clone(), tables.chunk_len.clone()
    offsets = tables.chunk_offsets.tolist()
    length[offsets[2]:offsets[3]] = 0
    rows = torch.ones(HOLE_CU[-1], dtype=torch.bool, device="cuda")
    rows[1:300] = False
    rows[1200:] = False
    return (start, length), rows


@pytest.mark.parametrize("C", [16, 32, 64])
def test_rows_outside_the_chunks_untouched(C):
    st = stage_inputs(1, HOLE_CU[-1], 4, 64, C, BF16, cu=HOLE_CU)
    tables, rows = tables_with_holes(st)
    for kind, names, got, ref in (("wy_fwd", FWD_NAMES, run_fwd(st, tables), ref_fwd(st)),
                                  ("wy_bwd", BWD_NAMES, run_bwd(st, tables), ref_bwd(st))):
        for n, g in zip(names, got):
            assert g[:, ~rows].isnan().all(), f"{kind}: {n} written outside the listed chunks"
        compare(f"{kind} holes C{C}", names, got, ref, BF16, rows)


# ---- schedule knobs give the same answer ----

@pytest.mark.parametrize("knobs,K,C", [
    (dict(fwd=dict(threads=128, stage_ab=True, late_data=False, min_blocks=0),
          bwd=dict(threads=128)), 128, 64),   # C = 64: one warpgroup for the backward
    (dict(fwd=dict(late_data=True), bwd=dict(threads=64)), 64, 32),
], ids=["C64-one-warpgroup", "C32-late-data-two-warps"])
def test_schedule_knobs(knobs, K, C):
    st = stage_inputs(1, 1000, 4, K, C, BF16)
    check_both(f"B1 T1000 H4 K{K} C{C} bf16 {knobs}", st, **knobs)


def test_configs_used_here_are_in_variants():
    """The compile test's variant lists cover the default configs this file runs."""
    for module in (wf, wb):
        listed = {(v["C"], v["K"], v["V"], v["dtype"]) for v in module.variants()}
        assert len(listed) == 3 * 2 * 2
        for C in (16, 32, 64):
            for K in (64, 128):
                for dt in ("bfloat16", "float16"):
                    assert (C, K, K, dt) in listed, (module.__name__, C, K, dt)
