"""GPU parity (and a timing print) of the fused no-grad forward kernel (csrc_tl/fused_fwd.py).

The kernel is called directly (no op dispatch) in its one form, a list of sequences: a rect
batch is flattened to [1, B*T, ...] with cu_seqlens [0, T, 2T, ...] (``kernel_tables``),
h0 absent as a size-0 tensor. Two references:

* the staged PyTorch forward (``fused_fwd.ref_program``: intra -> WY -> state references, fp32
  math), with the end-to-end bars of ``torch_dplr.testing.TOLERANCES`` (the same bars the
  staged GPU pipeline meets);
* the staged TileLang kernels (intra_fwd, wy_fwd, state_fwd called directly on the same
  inputs): the fused kernel keeps their rounding points, so the difference should be
  summation order inside wgmma only (bars ``FUSED_VS_STAGED_TOL``, a few bf16 ulps).

Outputs are pre-filled with NaN so an unwritten row shows up. Errors are printed
(``pytest -rA``). Kernels come from TILELANG_CACHE_DIR when it was filled beforehand.
"""
from __future__ import annotations

import functools

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32_matmul")]

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import fused_fwd as ff  # noqa: E402
from csrc_tl import intra_fwd as if_mod  # noqa: E402
from csrc_tl import state_fwd as sf_mod  # noqa: E402
from csrc_tl import wy_fwd as wy_mod  # noqa: E402
from torch_dplr.ops.shapes import allocate, intra_fwd_shapes, state_fwd_shapes, wy_fwd_shapes  # noqa: E402
from torch_dplr.ops.varlen import as_one_sequence_list as flat  # noqa: E402
from torch_dplr.ops.varlen import kernel_tables  # noqa: E402
from torch_dplr.testing import (FUSED_VS_STAGED_TOL, RWKV7_BOUND, TOLERANCES,  # noqa: E402
                                make_inputs, rms_ratio)

BF16, FP16 = torch.bfloat16, torch.float16
C = 64
STAGED_TOL = FUSED_VS_STAGED_TOL


@functools.lru_cache(maxsize=8)
def inputs(B, T, H, K, dtype, gates="rwkv7", cu=None, gate_dtype=torch.float32, seed=0):
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(B, T, H, K, dtype=dtype, gates=gates, seed=seed, device="cuda", num_states=N)
    inp["gk"] = inp["gk"].to(gate_dtype)
    inp["cu"] = (torch.tensor(cu, dtype=torch.int64, device="cuda") if cu is not None
                 else torch.empty(0, dtype=torch.int64, device="cuda"))
    return inp


def run_fused(inp, use_h0, scale, **config):
    q, v, gk, cu = inp["q"], inp["v"], inp["gk"], inp["cu"]
    B, T, H, K = q.shape
    V = v.shape[-1]
    kernel = tlc.build(ff.fused_fwd_kernel, C=C, K=K, V=V, dtype=q.dtype, gate_dtype=gk.dtype,
                       **config)
    N = B if cu.numel() == 0 else cu.numel() - 1
    o = torch.full_like(v, float("nan"))
    ht = torch.full((N, H, K, V), float("nan"), device=v.device)
    tables = kernel_tables(cu, B, T, C, v.device)
    h0 = inp["initial_state"].contiguous() if use_h0 else ht.new_empty(0, H, K, V)
    flags = torch.zeros(N, H, dtype=torch.int32, device=v.device)
    args = (*map(flat, (inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], gk)), h0,
            tables.cu_seqlens, tables.chunk_offsets, float(scale), flat(o), ht, flags)
    kernel(*args)
    torch.cuda.synchronize()
    return o, ht, (kernel, args)


def run_staged_kernels(inp, use_h0, scale):
    """The staged TileLang forward (intra_fwd -> wy_fwd -> state_fwd, no kept activations),
    kernels called directly as their GPU tests do."""
    q, k, v, a, b, gk, cu = (inp[n] for n in ("q", "k", "v", "a", "b", "gk", "cu"))
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = q.dtype
    tables = kernel_tables(cu, B, T, C, v.device)
    intra = tlc.build(if_mod.intra_fwd_kernel, C=C, K=K, dtype=dt, scheme="centred",
                      gate_dtype=gk.dtype)
    wy = tlc.build(wy_mod.wy_fwd_kernel, C=C, K=K, V=V, dtype=dt)
    state = tlc.build(sf_mod.state_fwd_kernel, C=C, K=K, V=V, dtype=dt)
    outs = allocate(intra_fwd_shapes(q, gk, cu, C), q.device)
    intra(*map(flat, (q, k, a, b, gk)), tables.chunk_start, tables.chunk_len, float(scale),
          *map(flat, outs))
    gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = outs
    A_inv, w, u = allocate(wy_fwd_shapes(A_ab, ag, v), v.device)
    wy(*map(flat, (A_ab, A_ak, ag, v)), tables.chunk_start, tables.chunk_len,
       *map(flat, (A_inv, w, u)))
    o, ht, _, _ = allocate(state_fwd_shapes(qg, v, gl, cu, False), v.device)
    h0 = inp["initial_state"].contiguous() if use_h0 else ht.new_empty(0, H, K, V)
    state(*map(flat, (qg, kg, bg, w, u, v, A_qk, A_qb, gl)), h0, tables.cu_seqlens,
          tables.chunk_offsets, flat(o), ht, gl.new_empty(1, 0, H, K, V), v.new_empty(1, 0, H, V))
    torch.cuda.synchronize()
    return o, ht


def reference(inp, use_h0, scale):
    h0 = inp["initial_state"] if use_h0 else inp["initial_state"].new_empty(0)
    return ff.ref_program(inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], inp["gk"], h0,
                          inp["cu"], scale, C, use_h0, RWKV7_BOUND)


def check(name, inp, use_h0=True, staged=True, **config):
    scale = inp["q"].shape[-1] ** -0.5
    o, ht, _ = run_fused(inp, use_h0, scale, **config)
    assert torch.isfinite(o).all(), f"{name}: o has non-finite values (unwritten rows?)"
    assert torch.isfinite(ht).all(), f"{name}: ht has non-finite values"
    ro, rht = reference(inp, use_h0, scale)
    bar = TOLERANCES[inp["q"].dtype][0]
    errs = dict(o=rms_ratio(o, ro), ht=rms_ratio(ht, rht))
    line = f"fused_fwd {name} {config or ''}: vs reference o={errs['o']:.2e} ht={errs['ht']:.2e}"
    if staged:
        so, sht = run_staged_kernels(inp, use_h0, scale)
        diff = dict(o=rms_ratio(o, so), ht=rms_ratio(ht, sht))
        bitwise = bool(torch.equal(o, so))
        line += f"; vs staged kernels o={diff['o']:.2e} ht={diff['ht']:.2e} (o bitwise {bitwise})"
    print(line)
    bad = {n: e for n, e in errs.items() if not e <= bar}
    assert not bad, f"{name}: over the end-to-end bar {bar}: {bad}"
    if staged:
        tol = STAGED_TOL[inp["q"].dtype]
        bad = {n: e for n, e in diff.items() if not e <= tol[n]}
        assert not bad, f"{name}: differs from the staged kernels beyond {tol}: {bad}"


# ---- real sizes, rect ----

@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("gate_dtype", ["fp32", "data"])
def test_real_size(dtype, gate_dtype):
    gdt = torch.float32 if gate_dtype == "fp32" else dtype
    inp = inputs(2, 2048, 16, 64, dtype, gate_dtype=gdt)
    check(f"B2 T2048 H16 K64 {dtype} gates {gdt}", inp)


def test_saturated_gates_no_h0():
    inp = inputs(1, 4096, 8, 64, BF16, gates="saturated")
    check("B1 T4096 H8 saturated gates (no h0)", inp, use_h0=False)


# ---- odd sizes and varlen ----

@pytest.mark.parametrize("T", [1, 37, 64, 65, 1000])
def test_odd_lengths(T):
    inp = inputs(2, T, 3, 64, BF16)
    check(f"B2 T{T} H3", inp)


CU_A = (0, 1, 1, 700, 701, 2000)       # 1 token, empty, long, 1 token, long
CU_B = (0, 0, 64, 64, 97, 1153, 1160)  # empty first, exactly one chunk, short tail


@pytest.mark.parametrize("cu", [CU_A, CU_B])
def test_varlen(cu):
    inp = inputs(1, cu[-1], 4, 64, BF16, cu=cu)
    check(f"varlen {cu} H4", inp)


def test_varlen_many_short_sequences_fp16():
    lens = [1, 0, 63, 64, 65, 200, 3, 0, 129, 500]
    cu = tuple(int(x) for x in torch.tensor([0] + lens).cumsum(0))
    inp = inputs(1, cu[-1], 4, 64, FP16, cu=cu)
    check(f"varlen {len(lens)} seqs H4 fp16", inp, use_h0=False)


# ---- schedule knobs: the intra products in two passes (operands formed twice) over 32- or
# 16-column blocks; V-blocks recompute the chunk-local work; the inverse chain contracted over
# its nonzero blocks only; two warpgroups per CTA (same answer up to summation order) ----

SEPARATE = dict(share_operands=False, block_k=32)  # two passes over 32-column blocks


@pytest.mark.parametrize("knobs", [SEPARATE, dict(share_operands=False, block_k=16),
                                   dict(SEPARATE, BV=32), dict(SEPARATE, trim_chain=True),
                                   dict(SEPARATE, threads=256),
                                   dict(SEPARATE, threads=256, min_blocks=1),
                                   dict(threads=256, block_k=32)])
def test_schedule_knobs(knobs):
    inp = inputs(1, 1000, 4, 64, BF16)
    check("B1 T1000 H4", inp, **knobs)


# ---- timing at the design shape (prints; the assert only guards against a regression) ----

def _time_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def test_design_shape_against_staged_kernels():
    """At the design shape the fused o and ht match the staged kernels'; the two are also
    timed and printed (the benchmarks, not this test, judge speed)."""
    inp = inputs(8, 4096, 32, 64, BF16)
    scale = 64 ** -0.5
    o, ht, (kernel, args) = run_fused(inp, False, scale)
    so, sht = run_staged_kernels(inp, False, scale)
    diff = dict(o=rms_ratio(o, so), ht=rms_ratio(ht, sht))
    fused = _time_ms(lambda: kernel(*args))
    staged = _time_ms(lambda: run_staged_kernels(inp, False, scale))
    print(f"design shape B8 T4096 H32 K64 C64 bf16: fused {fused:.3f} ms, staged kernels "
          f"{staged:.3f} ms (incl. allocations and syncs); fused vs staged {diff}")
    tol = STAGED_TOL[BF16]
    assert all(e <= tol[n] for n, e in diff.items()), (diff, tol)


def test_configs_used_here_are_in_variants():
    listed = list(ff.variants())
    used = [dict(C=64, K=64, V=64, dtype=dt, gate_dtype=g)
            for dt in ("bfloat16", "float16") for g in ("float32", dt)]
    assert all(cfg in listed for cfg in used)
