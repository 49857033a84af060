"""GPU parity of the TileLang state-pass forward (csrc_tl/state_fwd.py) with its PyTorch kernel.

The kernel is called directly (no op dispatch) on stage inputs made by the PyTorch reference
stages (intra, WY) on CUDA, in the one form it has for rect and varlen: a list of sequences
(a rect batch flattened to [1, B*T, ...] with cu_seqlens [0, T, 2T, ...], tables from
``kernel_tables``; absent h0 / activations as size-0 tensors). Every output, read back in the
op's shapes, is compared with
``torch_dplr.ops.state.chunk_state_fwd_reference``: o, the final state, and with
``keep_activations`` the per-chunk start states h and v_new. Metric RMS(err)/RMS(ref) with a
bar per (dtype, split) plus finiteness; outputs are pre-filled with NaN so a row or slot the
kernel fails to write shows up. Errors are printed (``pytest -rA`` shows them), including the
precision of ``split=False`` (h and v_new rounded to the data dtype in the GEMMs) next to the
default hi/lo split on long-memory gates.

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
from csrc_tl import state_fwd as sf  # noqa: E402
from torch_dplr.ops.intra import chunk_intra_fwd_reference  # noqa: E402
from torch_dplr.ops.shapes import state_fwd_shapes  # noqa: E402
from torch_dplr.ops.state import chunk_state_fwd_reference  # noqa: E402
from torch_dplr.ops.varlen import as_one_sequence_list as flat  # noqa: E402
from torch_dplr.ops.varlen import kernel_tables  # noqa: E402
from torch_dplr.ops.wy import chunk_wy_fwd_reference  # noqa: E402
from torch_dplr.testing import RWKV7_BOUND, make_inputs, rms_ratio  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16

# RMS(err)/RMS(ref) bars per (dtype, split). o / v_new are rounded to the data dtype by both
# sides, so their error is mostly rounding flips; ht / h are fp32 on both sides.
# CPU emulation of the kernel's roundings (T=4096, long-memory gates): split=True gives o ~1e-4,
# states ~2e-6; split=False gives bf16 o ~3e-3, states ~1.6e-3 (fp16: 3.5e-4, 1.8e-4).
TOL = {
    (BF16, True): dict(o=2e-3, v_new=2e-3, ht=1e-4, h=1e-4),
    (BF16, False): dict(o=8e-3, v_new=8e-3, ht=5e-3, h=5e-3),
    (FP16, True): dict(o=5e-4, v_new=5e-4, ht=1e-4, h=1e-4),
    (FP16, False): dict(o=1.5e-3, v_new=1.5e-3, ht=8e-4, h=8e-4),
}


@functools.lru_cache(maxsize=8)
def stage_inputs(B, T, H, K, C, dtype, gates="rwkv7", cu=None, seed=0):
    """The state pass's inputs, made by the PyTorch intra and WY stages on CUDA."""
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(B, T, H, K, dtype=dtype, gates="rwkv7" if gates == "slow" else gates,
                      seed=seed, device="cuda", num_states=N)
    if gates == "slow":  # long memory: decays near 1, the state carries across many chunks
        g = torch.Generator().manual_seed(seed + 1)
        inp["gk"] = (RWKV7_BOUND * torch.sigmoid(torch.randn(B, T, H, K, generator=g) - 7)).cuda()
    cu_t = (torch.tensor(cu, dtype=torch.int64, device="cuda") if cu is not None
            else torch.empty(0, dtype=torch.int64, device="cuda"))
    bound = float("-inf") if gates == "unbounded" else RWKV7_BOUND
    q, k, v, a, b, gk = (inp[n] for n in ("q", "k", "v", "a", "b", "gk"))
    gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = chunk_intra_fwd_reference(
        q, k, a, b, gk, cu_t, K ** -0.5, C, bound)
    _, w, u = chunk_wy_fwd_reference(A_ab, A_ak, ag, v, cu_t, C)
    return dict(qg=qg, kg=kg, bg=bg, w=w, u=u, v=v, A_qk=A_qk, A_qb=A_qb, gl=gl,
                h0=inp["initial_state"], cu=cu_t, C=C)


def run_kernel(st, use_h0, keep, **config):
    """Build (or fetch) the kernel for ``st`` and run it; returns (o, ht, h, v_new) in the op's
    shapes (the kernel writes them through their flattened views)."""
    qg, v, gl, cu, C = st["qg"], st["v"], st["gl"], st["cu"], st["C"]
    B, T, H, K = qg.shape
    V = v.shape[-1]
    kernel = tlc.build(sf.state_fwd_kernel, C=C, K=K, V=V, dtype=v.dtype, **config)
    o, ht, h, v_new = (torch.full(shape, float("nan"), dtype=dt, device=v.device)
                       for shape, dt in state_fwd_shapes(qg, v, gl, cu, keep))
    tables = kernel_tables(cu, B, T, C, v.device)
    h0 = st["h0"] if use_h0 else gl.new_empty(0, H, K, V)
    # size 0 (Sh == 0): the kernel writes no activations
    kept = (flat(h), flat(v_new)) if keep else (gl.new_empty(1, 0, H, K, V), v.new_empty(1, 0, H, V))
    inputs = (st[n] for n in ("qg", "kg", "bg", "w", "u", "v", "A_qk", "A_qb", "gl"))
    kernel(*map(flat, inputs), h0, tables.cu_seqlens, tables.chunk_offsets, flat(o), ht, *kept)
    torch.cuda.synchronize()
    return o, ht, h, v_new


def reference(st, use_h0, keep):
    h0 = st["h0"] if use_h0 else st["h0"].new_empty(0)
    return chunk_state_fwd_reference(st["qg"], st["kg"], st["bg"], st["w"], st["u"], st["v"],
                                     st["A_qk"], st["A_qb"], st["gl"], h0, st["cu"], st["C"],
                                     use_h0, keep)


def check(name, st, use_h0=True, keep=True, split=True, tol=None, **knobs):
    """Run kernel and reference, print the errors, assert finiteness and the bars."""
    got = run_kernel(st, use_h0, keep, split=split, **knobs)
    ref = reference(st, use_h0, keep)
    names = ("o", "ht", "h", "v_new") if keep else ("o", "ht")
    tol = tol or TOL[(st["v"].dtype, split)]
    errs = {n: rms_ratio(g, r) for n, g, r in zip(("o", "ht", "h", "v_new"), got, ref) if n in names}
    print(f"state_fwd {name} split={split} {knobs or ''}: "
          + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    for n, g in zip(("o", "ht", "h", "v_new"), got):
        if n in names:
            assert torch.isfinite(g).all(), f"{name}: {n} has non-finite values (unwritten?)"
    bad = {n: e for n, e in errs.items() if not e <= tol[n]}
    assert not bad, f"{name}: over the bar {bad} (bars {tol})"
    return errs


# ---- real sizes, rect ----

@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("C", [16, 32, 64])
def test_real_size(C, K):
    st = stage_inputs(1, 2048, 16, K, C, BF16)
    check(f"B1 T2048 H16 K{K} C{C} bf16", st)


def test_real_size_large_no_state():
    st = stage_inputs(2, 4096, 32, 128, 64, BF16)
    check("B2 T4096 H32 K128 C64 bf16 (no h0, no keep)", st, use_h0=False, keep=False)


def test_real_size_fp16():
    st = stage_inputs(2, 4096, 32, 64, 32, FP16)
    check("B2 T4096 H32 K64 C32 fp16", st)


@pytest.mark.parametrize("gates,C", [("saturated", 64), ("unbounded", 64), ("unbounded", 16)])
def test_gate_styles(gates, C):
    st = stage_inputs(1, 2048, 16, 64, C, BF16, gates)
    check(f"B1 T2048 H16 K64 C{C} bf16 gates={gates}", st)


# ---- precision of the GEMMs with the fp32 state: hi/lo split versus one rounding ----

@pytest.mark.parametrize("dtype,K,C", [(BF16, 128, 64), (FP16, 64, 32)])
def test_split_precision_long_memory(dtype, K, C):
    st = stage_inputs(1, 4096, 8, K, C, dtype, "slow")
    exact = check(f"B1 T4096 H8 K{K} C{C} {dtype} gates=slow", st, split=True)
    cast = check(f"B1 T4096 H8 K{K} C{C} {dtype} gates=slow", st, split=False)
    assert exact["ht"] <= cast["ht"]  # the split is the more accurate one


# ---- odd sizes: T not a multiple of C, T shorter than a chunk ----

@pytest.mark.parametrize("T", [1, 37, 1000])
@pytest.mark.parametrize("C", [16, 32, 64])
def test_odd_sizes(T, C):
    st = stage_inputs(2, T, 3, 64, C, BF16)
    check(f"B2 T{T} H3 K64 C{C} bf16 (no h0)", st, use_h0=False)


def test_odd_size_fp16_k128():
    st = stage_inputs(2, 1000, 3, 128, 64, FP16)
    check("B2 T1000 H3 K128 C64 fp16 (no keep)", st, keep=False)


# ---- varlen: a 1-token sequence, empty ones, lengths on and off chunk boundaries ----

CU_A = (0, 1, 1, 700, 701, 2000)      # 1 token, empty, long, 1 token, long
CU_B = (0, 0, 64, 64, 97, 1153, 1160)  # empty first, exactly one chunk of 64, short tail


@pytest.mark.parametrize("C", [16, 32, 64])
def test_varlen(C):
    st = stage_inputs(1, 2000, 4, 64, C, BF16, cu=CU_A)
    check(f"varlen {CU_A} H4 K64 C{C} bf16", st)


def test_varlen_boundaries_k128():
    st = stage_inputs(1, 1160, 4, 128, 64, BF16, cu=CU_B)
    check(f"varlen {CU_B} H4 K128 C64 bf16 (no h0, no keep)", st, use_h0=False, keep=False)
    st16 = stage_inputs(1, 1160, 4, 128, 16, FP16, cu=CU_B)
    check(f"varlen {CU_B} H4 K128 C16 fp16", st16)


def test_varlen_many_sequences_unbounded():
    lens = [1, 0, 63, 64, 65, 200, 3, 0, 129, 500]
    cu = tuple(int(x) for x in torch.tensor([0] + lens).cumsum(0))
    st = stage_inputs(1, cu[-1], 4, 64, 32, BF16, "unbounded", cu=cu)
    check(f"varlen {len(lens)} seqs H4 K64 C32 bf16 gates=unbounded", st)


# ---- schedule knobs give the same answer ----

@pytest.mark.parametrize("knobs,K,C", [
    (dict(num_stages=1), 64, 64),   # no prefetch
    (dict(BV=64), 128, 32),         # wider V-block
    (dict(threads=256), 128, 64),   # two warpgroups
])
def test_schedule_knobs(knobs, K, C):
    st = stage_inputs(1, 1000, 4, K, C, BF16)
    check(f"B1 T1000 H4 K{K} C{C} bf16", st, **knobs)


def test_configs_used_here_are_in_variants():
    """One variant per (C, K=V, dtype) serves rect, varlen, with or without h0 and kept
    activations; the compile test's list holds every default config this file runs."""
    listed = list(sf.variants())
    assert len(listed) == 3 * 2 * 2
    assert all(set(cfg) == {"C", "K", "V", "dtype"} for cfg in listed)
    used = [(C, K, "bfloat16") for C in (16, 32, 64) for K in (64, 128)]
    used += [(32, 64, "float16"), (64, 128, "float16"), (16, 128, "float16")]
    assert all(dict(C=C, K=K, V=K, dtype=dt) in listed for C, K, dt in used)
