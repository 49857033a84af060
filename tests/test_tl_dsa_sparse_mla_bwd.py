"""The TileLang sparse MLA backward (csrc_tl/dsa_sparse_mla_bwd.py), the CUDA kernel of
``dsa::sparse_mla_bwd``, against the op's PyTorch kernel.

* No GPU: config checks; the op's CUDA function run on meta / CPU tensors with the kernel
  replaced by a check of its arguments against the traced kernel (``csrc_tl.launch_check``):
  which calls take the kernel (the forward's rule, plus o / do in q's dtype and fp32 lse /
  dlse), that the decision and the launch read no tensor value, the fallbacks; a CPU model of
  the kernel's algorithm (slot blocks, heads padded to the CTA's block, P and dS rounded to the
  data dtype, dkv summed per block and scattered) against the PyTorch backward within the bars.
* nvcc, no GPU: every variant compiles for sm_90a in ``tests/test_tl_dsa_sparse_mla.py``'s
  compile test (it builds every family of ``csrc_tl.DSA_KERNEL_MODULES``).
* GPU (marker ``cuda``): dq and dkv against ``torch_dplr.dsa.reference.sparse_mla.
  sparse_mla_bwd`` run in fp32 and taken before their rounding to the input dtype (the bars of
  ``torch_dplr.dsa.testing.TOLERANCES`` are against an unrounded reference), o and lse from the
  fp32 PyTorch forward (o rounded to the input dtype, as the op returns it): through the op at
  DeepSeek-V3.2 sizes (T 4096 packed with a padding tail, H 16 / 64 / 128, k 2048, D 576 / 512)
  with the PyTorch fallback forbidden, and by direct calls of every variant at small sizes with
  padded head blocks, -1 slots, rows without a valid key, k not a multiple of the slot block,
  random dlse, other schedules; dq pre-filled with NaN, rows of kv no slot selects must get an
  exact 0; dq identical and dkv within fp32 reordering error between two runs (the atomics);
  a CUDA graph replay.  Errors and the DeepSeek cases' times are printed (``pytest -s``).
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import dsa_sparse_mla_bwd as bwd  # noqa: E402
from csrc_tl import dsa_sparse_mla_fwd as fwd  # noqa: E402
from csrc_tl.launch_check import launch_checker  # noqa: E402
from test_tl_dsa_sparse_mla import (BF16, DEEPSEEK, FP16, VARIANT_HEADS,  # noqa: E402
                                    causal_indices, dtype_id, meta, random_inputs, reference,
                                    time_ms, variant_id)
from torch_dplr.dsa.ops import sparse_mla as op  # noqa: E402
from torch_dplr.dsa.reference import sparse_mla as ref  # noqa: E402
from torch_dplr.dsa.testing import (TOLERANCES, deterministic_algorithms,  # noqa: E402
                                    forbid_pytorch_kernels)
from torch_dplr.testing import rms_ratio  # noqa: E402

FACTORY = bwd.dsa_sparse_mla_bwd_kernel


# ---------------------------------------------------------------- inputs and the reference


def backward_inputs(q, kv, indices, scale, d_v, *, seed=0):
    """o (rounded to q's dtype) and lse from the fp32 PyTorch forward; random do and dlse."""
    o, lse = reference(q, kv, indices, scale, d_v)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(device=q.device, dtype=q.dtype)
    dlse = torch.randn(lse.shape, generator=gen).to(q.device)
    return o.to(q.dtype), lse, do, dlse


def reference_bwd(q, kv, indices, o, lse, do, dlse, scale, d_v):
    """The op's PyTorch backward in fp32: ``(dq, dkv)`` before their rounding to the input
    dtype; 64 queries per block on a GPU (the default block is sized for the CPU)."""
    T, H, D_qk = q.shape
    dq = torch.empty(T, H, D_qk, device=q.device)
    dkv = torch.zeros(kv.shape, device=q.device)
    block = 64 if q.is_cuda else ref.block_rows(indices.shape[1], H, D_qk)
    ref.sparse_mla_bwd(q.float(), kv.float(), indices, o.float(), lse, do.float(), dlse,
                       float(scale), d_v, dq, dkv, block)
    return dq, dkv


def selected_rows(indices, T_kv):
    """``[T_kv]`` bool: some valid slot selects the row."""
    idx = indices.long()
    hit = torch.zeros(T_kv + 1, dtype=torch.bool, device=indices.device)
    hit[torch.where((idx >= 0) & (idx < T_kv), idx, T_kv).flatten()] = True
    return hit[:T_kv]


def grad_parity(dq, dkv, dq_ref, dkv_ref, indices, dtype, label=""):
    """Assert dq and dkv match the reference within the DSA gradient bar; rows of kv that no
    valid slot selects must be exact zeros.  Returns the errors."""
    bar = TOLERANCES[dtype]["grad"]
    assert dq.dtype == dtype and dkv.dtype == dtype
    assert torch.isfinite(dq).all(), "non-finite (or unwritten) dq"
    assert torch.isfinite(dkv).all(), "non-finite dkv"
    assert (dkv[~selected_rows(indices, dkv.shape[0])] == 0).all(), "dkv of an unselected row"
    errors = dict(dq=rms_ratio(dq, dq_ref), dkv=rms_ratio(dkv, dkv_ref))
    print(f"{label} {dtype_id(dtype)}: dq {errors['dq']:.2e}, dkv {errors['dkv']:.2e} "
          f"(bar {bar:.0e})")
    assert errors["dq"] <= bar and errors["dkv"] <= bar, errors
    return errors


# ---------------------------------------------------------------- no GPU


def test_variants_are_the_forwards():
    """The backward builds a kernel for every forward variant (the op's rule is shared)."""
    every = list(bwd.variants())
    assert every == list(fwd.variants())
    assert len({tlc.cache_key(FACTORY, c) for c in every}) == len(every)
    for c in every:  # the factory's checks, without tracing
        bwd._check_config(c["D_qk"], c["d_v"], c["dtype"], c["block_H"],
                          bwd.block_slots(c["D_qk"], c["d_v"], c["block_H"]), 256)
    assert bwd.config_for is fwd.config_for


def test_shared_memory_keeps_a_margin():
    """At D_qk 576 with 64 heads per CTA 64 slots would not fit: the default takes 32 (and
    keeps the margin); every other built config keeps 64."""
    with pytest.raises(ValueError, match="shared memory"):
        FACTORY(D_qk=576, d_v=512, dtype="bfloat16", block_H=64, block_I=64)
    assert bwd.block_slots(576, 512, 64) == 32
    assert bwd.smem_bytes(576, 512, 64, 32) + bwd._SMEM_MARGIN <= bwd._SMEM_LIMIT
    assert {bwd.block_slots(D_qk, d_v, hb) for (D_qk, d_v), hb in
            itertools.product(bwd.DIMS, bwd.HEAD_BLOCKS) if (D_qk, hb) != (576, 64)} == {64}
    FACTORY(D_qk=576, d_v=512, dtype="bfloat16")  # the defaults are accepted


@pytest.mark.parametrize("bad", [
    dict(dtype="float32"), dict(dtype="int32"), dict(d_v=96), dict(D_qk=528), dict(D_qk=640),
    dict(D_qk=500), dict(block_H=48), dict(block_I=128), dict(threads=512),
    dict(threads=128),  # the 64 x 576 fp32 dq tile in one warpgroup: 288 registers a thread
    dict(block_I=64),  # at D_qk 576 / 64 heads: over the shared-memory limit
    dict(d_v=128, D_qk=192, block_H=16, block_I=32),  # 16 x 32 S tile over 8 warps
])
def test_bad_config_raises(bad):
    good = dict(D_qk=576, d_v=512, dtype="bfloat16", block_H=64)
    with pytest.raises(ValueError):
        FACTORY(**(good | bad))


@pytest.fixture
def cuda_body(monkeypatch):
    """The op's CUDA function made runnable on any tensors, as on an sm_90 GPU: its kernel is a
    stand-in that checks the launch's arguments against the traced kernel, that the tensors
    read 16 bytes at a time are 16-byte aligned and that dkv's accumulator starts at zero
    (where it has values), and launches nothing.  Yields the configs asked for."""
    asked = []

    def checking_kernel_for(family, config):
        assert family == "dsa_sparse_mla_bwd"
        asked.append(config)
        check = launch_checker(FACTORY, config)

        def launch(q, kv, indices, o, lse, do, dlse, scale, dq, dkv):
            assert all(x.data_ptr() % 16 == 0 for x in (q, kv, o, do))
            assert dkv.is_meta or not dkv.any()
            check(q, kv, indices, o, lse, do, dlse, scale, dq, dkv)
        return launch

    monkeypatch.setattr(op, "tilelang_usable", lambda device: True)
    monkeypatch.setattr(op, "kernel_for", checking_kernel_for)
    monkeypatch.delenv(op.BWD_KERNEL_SWITCH, raising=False)  # on by default
    return asked


def meta_args(T, H, D_qk, d_v, k, dtype, T_kv=11):
    return (meta(T, H, D_qk, dtype=dtype), meta(T_kv, D_qk, dtype=dtype),
            meta(T, k, dtype=torch.int32), meta(T, H, d_v, dtype=dtype),
            meta(T, H, dtype=torch.float32), meta(T, H, d_v, dtype=dtype),
            meta(T, H, dtype=torch.float32))


@pytest.mark.parametrize("H", [16, 20, 64, 96, 128])
@pytest.mark.parametrize("dims", bwd.DIMS, ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_cuda_body_launches_the_kernel_reading_no_value(cuda_body, H, dims, dtype):
    """Meta tensors have no values: any host read of one (a sync on the GPU) would raise."""
    D_qk, d_v = dims
    dq, dkv = op.sparse_mla_bwd_cuda(*meta_args(7, H, D_qk, d_v, 2048, dtype), 0.1, d_v)
    assert dq.shape == (7, H, D_qk) and dq.dtype == dtype
    assert dkv.shape == (11, D_qk) and dkv.dtype == dtype
    assert cuda_body == [fwd.config_for(D_qk, d_v, H, dtype)]


def cpu_args(T, H, D_qk, d_v, k, dtype, T_kv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D_qk, generator=gen).to(dtype)
    kv = torch.randn(T_kv, D_qk, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(T_kv + 1, generator=gen)[:k] - 1 for _ in range(T)]) \
        if T else torch.empty(0, k, dtype=torch.long)
    o = torch.randn(T, H, d_v, generator=gen).to(dtype)
    lse = torch.randn(T, H, generator=gen).to(torch.float64 if dtype == torch.float64
                                              else torch.float32)
    do = torch.randn(T, H, d_v, generator=gen).to(dtype)
    return [q, kv, idx.int(), o, lse, do, torch.randn(lse.shape, generator=gen).to(lse.dtype)]


def test_cuda_body_aligns_views_that_start_mid_row(cuda_body):
    args = cpu_args(3, 4, 64, 64, 2, BF16)
    for i in (0, 5):  # q and do, 2 bytes into their storage
        flat = torch.randn(args[i].numel() + 1).to(BF16)
        args[i] = flat[1:].view(args[i].shape)
    op.sparse_mla_bwd_cuda(*args, 0.1, 64)
    assert len(cuda_body) == 1


FALLBACKS = {  # case: (cpu_args's T, H, D_qk, d_v, k, dtype), {argument: dtype}
    "fp32": ((5, 3, 64, 64, 4, torch.float32), {}),
    "fp64": ((5, 3, 64, 64, 4, torch.float64), {}),
    "kv dtype": ((5, 3, 64, 64, 4, BF16), {1: FP16}),
    "int64 indices": ((5, 3, 64, 64, 4, BF16), {2: torch.int64}),
    "o dtype": ((5, 3, 64, 64, 4, BF16), {3: torch.float32}),
    "do dtype": ((5, 3, 64, 64, 4, BF16), {5: FP16}),
    "lse dtype": ((5, 3, 64, 64, 4, BF16), {4: torch.float64}),
    "dlse dtype": ((5, 3, 64, 64, 4, BF16), {6: torch.float64}),
    "dims not built": ((5, 3, 40, 32, 4, BF16), {}),
    "d_v not built": ((5, 3, 576, 256, 4, BF16), {}),
    "no slot": ((5, 3, 64, 64, 0, BF16), {}),
    "no token": ((0, 3, 64, 64, 4, BF16), {}),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_cuda_body_falls_back_to_the_pytorch_kernel(cuda_body, case):
    shape, casts = FALLBACKS[case]
    args = cpu_args(*shape)
    for i, dtype in casts.items():
        args[i] = args[i].to(dtype)
    d_v = shape[3]
    dq, dkv = op.sparse_mla_bwd_cuda(*args, 0.1, d_v)
    want = op.sparse_mla_bwd_reference(*args, 0.1, d_v)
    assert cuda_body == []
    assert torch.equal(dq, want[0]) and torch.equal(dkv, want[1])


def test_cuda_body_keeps_the_pytorch_kernel_when_switched_off(cuda_body, monkeypatch):
    monkeypatch.setenv(op.BWD_KERNEL_SWITCH, "0")
    args = cpu_args(5, 3, 64, 64, 4, BF16)
    dq, dkv = op.sparse_mla_bwd_cuda(*args, 0.1, 64)
    assert cuda_body == []
    assert torch.equal(dkv, op.sparse_mla_bwd_reference(*args, 0.1, 64)[1])


def test_cuda_body_obeys_the_disable_switch(monkeypatch):
    """``TORCH_DPLR_DISABLE_TILELANG=1`` (the DPLR ops' switch) keeps the PyTorch kernel."""
    def no_kernel(*args):
        raise AssertionError("a kernel was asked for")

    monkeypatch.setenv("TORCH_DPLR_DISABLE_TILELANG", "1")
    monkeypatch.setattr(op, "kernel_for", no_kernel)
    args = cpu_args(5, 3, 64, 64, 4, BF16)
    dq, dkv = op.sparse_mla_bwd_cuda(*args, 0.1, 64)
    assert torch.equal(dkv, op.sparse_mla_bwd_reference(*args, 0.1, 64)[1])


def test_forbid_pytorch_kernels_catches_a_fallback():
    args = cpu_args(5, 3, 64, 64, 4, torch.float32)
    with forbid_pytorch_kernels(), pytest.raises(AssertionError, match="GPU kernel was not used"):
        op.sparse_mla_bwd_cuda(*args, 0.1, 64)
    op.sparse_mla_bwd_cuda(*args, 0.1, 64)  # restored on exit


def kernel_model(q, kv, indices, o, lse, do, dlse, scale, d_v, block_H=64, block_I=32):
    """The kernel's arithmetic on the CPU, in its order: heads padded to a multiple of block_H
    with zeros (lse and dlse too), delta in fp32, per block of slots S and dP in fp32,
    P = 2^(S · c - lse · log2 e) on valid slots (0 elsewhere), dS = scale · P · (dP - delta),
    P and dS rounded to the data dtype, dq accumulated in fp32, dkv per (token, head block)
    summed over its heads and scattered into fp32; each rounded once at the end."""
    dtype = q.dtype
    T, H, D_qk = q.shape
    pad = -H % block_H
    def padded(x):  # zero heads appended (dim 1)
        return torch.nn.functional.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, pad))

    qf, of, dof, lse, dlse = (padded(x) for x in (q, o, do, lse, dlse))
    kvf = kv.float()
    c, log2e = scale * math.log2(math.e), math.log2(math.e)
    delta = (dof * of).sum(-1) - dlse
    dq = torch.zeros(qf.shape)
    dkv = torch.zeros(kv.shape)
    heads = qf.shape[1]
    for b in range(0, indices.shape[1], block_I):
        idx = indices[:, b:b + block_I].long()
        valid = (idx >= 0) & (idx < kv.shape[0])
        rows = kvf[torch.where(valid, idx, 0)] * valid[..., None]  # zero-filled gather
        s = torch.einsum("thd,tkd->thk", qf, rows)
        p = torch.where(valid[:, None, :], torch.exp2(s * c - lse[..., None] * log2e), 0.0)
        dp = torch.einsum("thd,tkd->thk", dof, rows[..., :d_v])
        ds = p * (dp - delta[..., None]) * scale
        p, ds = p.to(dtype).float(), ds.to(dtype).float()
        dq += torch.einsum("thk,tkd->thd", ds, rows)
        for h0 in range(0, heads, block_H):  # one CTA's block, then its atomics
            hs = slice(h0, h0 + block_H)
            dk = torch.einsum("thk,thd->tkd", ds[:, hs], qf[:, hs])
            dk[..., :d_v] += torch.einsum("thk,thd->tkd", p[:, hs], dof[:, hs])
            dkv.index_add_(0, idx[valid], dk[valid])
    return dq[:, :H].to(dtype), dkv.to(dtype)


@pytest.mark.parametrize("H,block_H,block_I", [(8, 16, 64), (20, 32, 64), (96, 64, 32)])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_algorithm_model_meets_the_bars(dtype, H, block_H, block_I):
    """With the kernel's roundings (P and dS in the data dtype) and padded heads, dq and dkv
    stay within half their bar at DeepSeek dims (2,048 slots of random keys, -1 tails and
    holes, out-of-range slots, an empty row, random dlse)."""
    T, T_kv, k = 8 if H > 32 else 24, 4096, 2048
    D_qk, d_v = DEEPSEEK
    q, kv = random_inputs(T, H, D_qk, dtype, T_kv=T_kv, seed=1)
    gen = torch.Generator().manual_seed(2)
    idx = torch.stack([torch.randperm(T_kv, generator=gen)[:k] for _ in range(T)]).int()
    idx[::3, 1000:] = -1
    idx[::5, 7::11] = -1
    idx[1::4, 3::13] = T_kv + 5
    idx[4] = -1
    scale = D_qk ** -0.5
    clean = torch.where(idx < T_kv, idx, -1)  # the PyTorch kernel rejects out-of-range slots
    o, lse, do, dlse = backward_inputs(q, kv, clean, scale, d_v, seed=3)
    dq_ref, dkv_ref = reference_bwd(q, kv, clean, o, lse, do, dlse, scale, d_v)
    dq, dkv = kernel_model(q, kv, idx, o, lse, do, dlse, scale, d_v, block_H, block_I)
    errors = grad_parity(dq, dkv, dq_ref, dkv_ref, clean, dtype, f"CPU model H{H}")
    assert max(errors.values()) <= 0.5 * TOLERANCES[dtype]["grad"]


# ---------------------------------------------------------------- GPU

SMALL = dict(D_qk=192, d_v=128, dtype="float16", block_H=32)
SCHEDULES = [dict(block_I=32), dict(threads=128), dict(block_I=32, threads=128)]
# DeepSeek dims, H 128: the default (64 heads, 32 slots) and 32 heads per CTA (64 slots, over
# 256 or 128 threads)
DEEPSEEK_SCHEDULES = [dict(), dict(block_H=32), dict(block_H=32, threads=128)]


@pytest.fixture(scope="module")
def gpu_kernels():
    """Every kernel the GPU tests launch, compiled up front by parallel processes; from
    TILELANG_CACHE_DIR when it was filled before (``python -m torch_dplr precompile``)."""
    if torch.cuda.get_device_capability() != (9, 0):  # the kernels are built for sm_90a only
        pytest.skip("needs an sm_90 GPU (H100 / H200)")
    configs = list(bwd.variants()) + [SMALL | s for s in SCHEDULES]
    configs += [fwd.config_for(*DEEPSEEK, 128, BF16) | s for s in DEEPSEEK_SCHEDULES[1:]]
    tlc.build_all([(FACTORY, c) for c in configs], progress=print, load=False)


gpu = pytest.mark.usefixtures("ieee_fp32_matmul", "gpu_kernels")


@pytest.fixture
def tilelang_only(monkeypatch):
    """Through the op, a fall back to the PyTorch kernel fails the test."""
    monkeypatch.delenv("TORCH_DPLR_DISABLE_TILELANG", raising=False)
    monkeypatch.delenv(op.BWD_KERNEL_SWITCH, raising=False)  # on by default
    with forbid_pytorch_kernels():
        yield


def run_direct(q, kv, indices, o, lse, do, dlse, scale, d_v, **schedule):
    """The compiled kernel called directly: dq pre-filled with NaN, dkv's fp32 accumulator
    zeroed; returns ``(dq, dkv rounded to kv's dtype, the fp32 accumulator)``."""
    config = fwd.config_for(q.shape[2], d_v, q.shape[1], q.dtype) | schedule
    kernel = tlc.build(FACTORY, **config)
    dq = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    acc = torch.zeros(kv.shape, device=q.device)
    kernel(q, kv, indices, o, lse, do, dlse, float(scale), dq, acc)
    torch.cuda.synchronize()
    return dq, acc.to(kv.dtype), acc


def deepseek_case(H, dtype):
    """T 4096 packed as a 1-token, a 1535-token, an empty and a 2464-token sequence plus a
    96-token padding tail (rows without a key), k 2048."""
    q, kv = random_inputs(4096, H, DEEPSEEK[0], dtype, device="cuda")
    idx = causal_indices(4096, 2048, [0, 1, 1536, 1536, 4000], device="cuda")
    scale = DEEPSEEK[0] ** -0.5
    return (q, kv, idx, *backward_inputs(q, kv, idx, scale, DEEPSEEK[1]), scale)


def flops(T, H, k):
    """Multiply-adds x 2 of the five products, every slot counted (valid or not)."""
    D_qk, d_v = DEEPSEEK
    return 2 * T * H * k * (3 * D_qk + 2 * d_v)


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_op_at_deepseek_sizes(tilelang_only, H, dtype):
    """Through ``torch.ops.dsa.sparse_mla_bwd`` (the TileLang path: the fallback is
    forbidden); prints the op's time (the kernel, dkv's zeroing and its cast)."""
    q, kv, idx, o, lse, do, dlse, scale = args = deepseek_case(H, dtype)
    d_v = DEEPSEEK[1]
    dq, dkv = torch.ops.dsa.sparse_mla_bwd(*args, d_v)
    grad_parity(dq, dkv, *reference_bwd(*args, d_v), idx, dtype, f"T4096 H{H} k2048")
    ms = time_ms(lambda: torch.ops.dsa.sparse_mla_bwd(*args, d_v))
    print(f"  {ms:.3f} ms, {flops(4096, H, 2048) / ms / 1e9:.0f} TFLOP/s over all slots")


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("schedule", DEEPSEEK_SCHEDULES,
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()) or "default")
def test_deepseek_schedules(schedule):
    """H 128 bf16 at D 576: the default against 32 heads per CTA (four head blocks per
    token, 64 slots): same results up to summation order; prints each kernel's time."""
    q, kv, idx, o, lse, do, dlse, scale = args = deepseek_case(128, BF16)
    dq, dkv, _ = run_direct(*args, DEEPSEEK[1], **schedule)
    grad_parity(dq, dkv, *reference_bwd(*args, DEEPSEEK[1]), idx, BF16, str(schedule))
    kernel = tlc.build(FACTORY, **fwd.config_for(*DEEPSEEK, 128, BF16) | schedule)
    acc = torch.zeros(kv.shape, device="cuda")
    ms = time_ms(lambda: kernel(q, kv, idx, o, lse, do, dlse, scale, dq, acc))
    print(f"  {ms:.3f} ms (kernel only)")


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("config", list(bwd.variants()), ids=variant_id)
def test_every_variant(config):
    """Every variant the op can pick, at small sizes: padded head blocks, a 1-token sequence,
    a padding tail, k = 100 (not a multiple of the slot block), -1 tails, holes and an
    explicit row of -1."""
    T, k, H = 300, 100, VARIANT_HEADS[config["block_H"]]
    D_qk, d_v, dtype = config["D_qk"], config["d_v"], getattr(torch, config["dtype"])
    assert fwd.config_for(D_qk, d_v, H, dtype) == config
    q, kv = random_inputs(T, H, D_qk, dtype, seed=H, device="cuda")
    idx = causal_indices(T, k, [0, 1, 130, 280], seed=H, device="cuda")
    idx[200] = -1
    scale = 0.7 * D_qk ** -0.5
    args = (q, kv, idx, *backward_inputs(q, kv, idx, scale, d_v, seed=H), scale)
    dq, dkv, _ = run_direct(*args, d_v)
    grad_parity(dq, dkv, *reference_bwd(*args, d_v), idx, dtype, variant_id(config))


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("k", [1, 5, 64, 65])
def test_few_slots_and_a_longer_kv(k):
    """k below, at and just past one slot block; kv with more rows than q (T_kv != T)."""
    T, T_kv, H = 37, 500, 16
    D_qk, d_v = 192, 128
    q, kv = random_inputs(T, H, D_qk, BF16, T_kv=T_kv, seed=k, device="cuda")
    gen = torch.Generator().manual_seed(k)
    idx = torch.stack([torch.randperm(T_kv + 1, generator=gen)[:k] - 1 for _ in range(T)])
    idx = idx.to(device="cuda", dtype=torch.int32)
    args = (q, kv, idx, *backward_inputs(q, kv, idx, D_qk ** -0.5, d_v, seed=k), D_qk ** -0.5)
    dq, dkv, _ = run_direct(*args, d_v)
    grad_parity(dq, dkv, *reference_bwd(*args, d_v), idx, BF16, f"k{k}")


@pytest.mark.cuda
@gpu
def test_out_of_range_indices_count_as_empty_slots(tilelang_only):
    """On CUDA the op does not read the indices on the host: values below -1 or at / past
    T_kv never touch kv or dkv, they are empty slots, like -1."""
    T, H, k = 64, 16, 96
    q, kv = random_inputs(T, H, 64, BF16, device="cuda")
    idx = causal_indices(T, k, None, device="cuda", holes=False)
    wild = idx.clone()
    wild[:, ::4] = T + 1000
    wild[:, 1::4] = -7
    clean = torch.where((wild >= 0) & (wild < T), wild, -1)
    o, lse, do, dlse = backward_inputs(q, kv, clean, 0.125, 64)
    dq, dkv = torch.ops.dsa.sparse_mla_bwd(q, kv, wild, o, lse, do, dlse, 0.125, 64)
    grad_parity(dq, dkv, *reference_bwd(q, kv, clean, o, lse, do, dlse, 0.125, 64), clean,
                BF16, "out of range")


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("schedule", SCHEDULES,
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_schedule_knobs(schedule):
    """Other schedules give the same results up to summation order (the bars)."""
    T, H, k = 200, 20, 150
    D_qk, d_v = SMALL["D_qk"], SMALL["d_v"]
    q, kv = random_inputs(T, H, D_qk, FP16, device="cuda")
    idx = causal_indices(T, k, [0, 120, 190], device="cuda")
    args = (q, kv, idx, *backward_inputs(q, kv, idx, D_qk ** -0.5, d_v), D_qk ** -0.5)
    dq, dkv, _ = run_direct(*args, d_v, **schedule)
    grad_parity(dq, dkv, *reference_bwd(*args, d_v), idx, FP16, str(schedule))


@pytest.mark.cuda
@gpu
def test_dq_is_deterministic_and_dkv_within_reordering_error():
    """Two runs on the same inputs: dq identical (each CTA owns its rows), dkv's fp32
    accumulator equal up to the order of its atomic adds (a kv row here takes the terms of
    hundreds of (token, head block) pairs)."""
    T, H, k = 1024, 128, 512
    q, kv = random_inputs(T, H, DEEPSEEK[0], BF16, device="cuda")
    idx = causal_indices(T, k, None, device="cuda")
    scale = DEEPSEEK[0] ** -0.5
    args = (q, kv, idx, *backward_inputs(q, kv, idx, scale, DEEPSEEK[1]), scale)
    dq1, _, acc1 = run_direct(*args, DEEPSEEK[1])
    dq2, _, acc2 = run_direct(*args, DEEPSEEK[1])
    assert torch.equal(dq1, dq2)
    # a reordered fp32 sum of n terms moves by at most (n - 1) · 2^-24 · Σ|terms| (first
    # order); here n <= T · 2 head blocks, and RMS(acc) stands in for Σ|terms| (no larger)
    diff = rms_ratio(acc1, acc2)
    print(f"dkv run to run: {diff:.2e} (RMS ratio), max |diff| "
          f"{(acc1 - acc2).abs().max().item():.2e}")
    assert diff <= 2 * T * 2.0 ** -24


@pytest.mark.cuda
@gpu
def test_op_replays_in_a_cuda_graph(tilelang_only):
    """The op's CUDA path syncs nothing: it captures into a CUDA graph (once its kernel is
    loaded) and the replay is right."""
    T, H, k = 256, 20, 80
    q, kv = random_inputs(T, H, 192, BF16, device="cuda")
    idx = causal_indices(T, k, [0, 100, 256], device="cuda")
    args = (q, kv, idx, *backward_inputs(q, kv, idx, 0.1, 128), 0.1)
    torch.ops.dsa.sparse_mla_bwd(*args, 128)  # loads the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dq, dkv = torch.ops.dsa.sparse_mla_bwd(*args, 128)
    dq.fill_(float("nan"))
    dkv.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    grad_parity(dq, dkv, *reference_bwd(*args, 128), idx, BF16, "graph replay")


@pytest.mark.cuda
def test_op_keeps_the_pytorch_kernel_elsewhere():
    """fp32 data and dims without a variant run the PyTorch kernel on the GPU too."""
    for D_qk, d_v, dtype in [(64, 64, torch.float32), (40, 32, BF16)]:
        q, kv = random_inputs(50, 3, D_qk, dtype, device="cuda")
        idx = causal_indices(50, 9, None, device="cuda")
        args = (q, kv, idx, *backward_inputs(q, kv, idx, 0.2, d_v), 0.2, d_v)
        with deterministic_algorithms():
            got = torch.ops.dsa.sparse_mla_bwd(*args)
            want = op.sparse_mla_bwd_reference(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
