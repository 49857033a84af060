"""The TileLang indexer scores and their backward (csrc_tl/dsa_indexer_fwd.py,
csrc_tl/dsa_indexer_bwd.py), the CUDA kernels of ``dsa::indexer_fwd`` / ``dsa::indexer_bwd``,
against the ops' PyTorch kernels.

* No GPU: config checks; a CPU model of the gathers' cp.async schedule (one group per
  iteration, ``wait_group(num_stages - 1)``: block i and q have landed when block i computes,
  no gather refills a buffer that a later compute still needs); CPU models of both kernels'
  arithmetic (slot blocks, zero-filled invalid rows, the backward's normalized operands rounded
  to the data dtype, its per-block scatter) against the PyTorch kernels: the forward exact on
  integer inputs, the backward within half the gradient bars at DeepSeek dims, also with
  training-sized (tiny) dscores, where unnormalized fp16 operands fail the bar.  The ops' CUDA
  functions run on meta / CPU tensors with the kernel replaced by a check of its arguments
  against the traced kernel (``csrc_tl.launch_check``): which calls take the kernel, that the
  decision and the launch read no tensor value, the fallbacks, the opt-out and disable
  switches; on CPU tensors the stand-in runs the kernel model, so the op's own steps (dk_idx's
  fp32 accumulator and cast, dw in w's dtype) are checked end to end.
* nvcc, no GPU: every variant of both families compiled for sm_90a into an empty TileLang
  cache (times printed).
* GPU (marker ``cuda``): through the ops at DeepSeek sizes (T 8192 packed with a padding tail,
  H_idx 64, D_idx 128, k 2048, distinct random indices in random order with holes) with the
  fallback forbidden: integer inputs (every sum exact) equal to the PyTorch kernels bit for bit,
  dk_idx included; random inputs within the bars (scores at fp32 round-off); fp16 with
  training-sized dscores; times printed.  Direct calls of every variant at small sizes with
  outputs pre-filled with NaN: -1 slots, out-of-range slots, rows without a valid slot, padding
  rows, k from 1 past the slot block, NaN dscores at invalid slots; other schedules; dq_idx / dw
  identical and dk_idx within fp32 reordering error between runs; non-finite inputs; a CUDA
  graph replay of forward and backward.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import dsa_indexer_bwd as ibwd  # noqa: E402
from csrc_tl import dsa_indexer_fwd as ifwd  # noqa: E402
from csrc_tl.launch_check import launch_checker  # noqa: E402
from test_tl_dsa_sparse_mla import causal_indices  # noqa: E402
from torch_dplr.dsa.ops import indexer as op  # noqa: E402
from torch_dplr.dsa.reference import indexer as ref  # noqa: E402
from torch_dplr.dsa.testing import TOLERANCES, deterministic_algorithms  # noqa: E402
from torch_dplr.testing import rms_ratio  # noqa: E402

try:  # the compile test's empty-cache fixture; importing it skips without nvcc
    from test_tl_compile import cold_cache  # noqa: F401, E402  (a fixture)
    HAVE_NVCC = True
except pytest.skip.Exception:
    HAVE_NVCC = False

BF16, FP16 = torch.bfloat16, torch.float16
FWD, BWD = ifwd.dsa_indexer_fwd_kernel, ibwd.dsa_indexer_bwd_kernel
FAMILIES = {"dsa_indexer_fwd": FWD, "dsa_indexer_bwd": BWD}
DEEPSEEK = (64, 128)  # H_idx, D_idx
SCORE_BAR = 1e-5  # RMS ratio of fp32 scores summed in another order (fp32 round-off)
dtype_id = lambda d: str(d).removeprefix("torch.")  # noqa: E731
NAN = float("nan")


# ---------------------------------------------------------------- inputs and references


def integer_inputs(T, H, D, dtype, *, seed=0, device="cpu"):
    """q_idx, k_idx in {-2..2}, w in {-1, -1/2, 1/2, 1, 2}: every score is an exact fp32 number
    in any summation order, and so is every gradient of :func:`dyadic_dscores`."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (T, H, D), generator=gen).to(dtype)
    k = torch.randint(-2, 3, (T, D), generator=gen).to(dtype)
    w = torch.tensor([-1.0, -0.5, 0.5, 1.0, 2.0])[torch.randint(0, 5, (T, H), generator=gen)]
    return q.to(device), k.to(device), w.to(device)


def dyadic_dscores(T, k, *, seed=0, device="cpu"):
    """dscores in {0, ±1/32, ±1/16}: with integer inputs the kernels' normalized operands and
    every fp32 partial sum stay exact (the row maxima are powers of two)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-2, 3, (T, k), generator=gen).float() / 32).to(device)


def random_inputs(T, H, D, dtype, *, seed=0, device="cpu"):
    """DeepSeek-like: unit-normal q_idx, k_idx; w scaled by (H · D) ** -0.5."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k = torch.randn(T, D, generator=gen).to(dtype)
    w = torch.randn(T, H, generator=gen) * (H * D) ** -0.5
    return q.to(device), k.to(device), w.to(device)


def random_dscores(T, k, scale=1.0, *, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, k, generator=gen) * scale).to(device)


def with_nan_at_invalid(dscores, indices):
    """dscores with NaN at every -1 slot: the kernels must never use them."""
    return torch.where(indices >= 0, dscores, NAN)


def reference_fwd(q, k, w, indices):
    """The op's PyTorch kernel in fp32 (64 queries per block on a GPU)."""
    out = torch.empty(indices.shape, device=q.device)
    block = 64 if q.is_cuda else ref.block_rows(indices.shape[1], q.shape[1] + k.shape[1])
    return ref.indexer_fwd(q.float(), k.float(), w.float(), indices, out, block)


def reference_bwd(q, k, w, indices, dscores):
    """The op's PyTorch backward in fp32: ``(dq_idx, dk_idx, dw)`` before their rounding."""
    T, H, D = q.shape
    dq = torch.empty(T, H, D, device=q.device)
    dk = torch.zeros(k.shape, device=q.device)
    dw = torch.empty(T, H, device=q.device)
    block = 64 if q.is_cuda else ref.block_rows(indices.shape[1], H + D)
    ref.indexer_bwd(q.float(), k.float(), w.float(), indices, dscores.float(), dq, dk, dw, block)
    return dq, dk, dw


def score_parity(got, want, label=""):
    """-inf exactly where the reference has it; the rest within fp32 round-off."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    empty = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), empty), "-inf on other slots than the reference's"
    assert torch.isfinite(got[~empty]).all(), "non-finite (or unwritten) score"
    err = rms_ratio(got[~empty], want[~empty])
    print(f"{label}: scores {err:.2e} (bar {SCORE_BAR:.0e}), {int(empty.sum())} empty slots")
    assert err <= SCORE_BAR


def selected_rows(indices, T):
    """``[T]`` bool: some valid slot selects the key."""
    idx = indices.long()
    hit = torch.zeros(T + 1, dtype=torch.bool, device=indices.device)
    hit[torch.where((idx >= 0) & (idx < T), idx, T).flatten()] = True
    return hit[:T]


def grad_parity(grads, want, indices, dtype, label="", bar_scale=1.0):
    """dq_idx, dk_idx, dw against the unrounded reference within the DSA gradient bar; keys no
    valid slot selects must get an exact 0.  Returns the errors."""
    bar = bar_scale * TOLERANCES[dtype]["grad"]
    dq, dk, dw = grads
    assert all(torch.isfinite(g).all() for g in grads), "non-finite (or unwritten) gradient"
    assert (dk[~selected_rows(indices, dk.shape[0])] == 0).all(), "dk_idx of an unselected key"
    errors = dict(dq=rms_ratio(dq, want[0]), dk=rms_ratio(dk, want[1]), dw=rms_ratio(dw, want[2]))
    print(f"{label} {dtype_id(dtype)}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items())
          + f" (bar {bar:.1e})")
    assert max(errors.values()) <= bar, errors
    return errors


# ---------------------------------------------------------------- CPU models of the kernels


def fwd_model(q, k, w, indices, block_I=64):
    """The forward's arithmetic: per block of slots the zero-filled gathered rows, fp32
    products, ReLU, times w, summed over the heads; -inf on invalid slots."""
    T = q.shape[0]
    out = torch.empty(indices.shape)
    qf, kf, wf = q.float(), k.float(), w.float()
    for b in range(0, indices.shape[1], block_I):
        idx = indices[:, b:b + block_I].long()
        valid = (idx >= 0) & (idx < T)
        rows = kf[torch.where(valid, idx, 0)] * valid[..., None]
        s = torch.einsum("tjd,thd->tjh", rows, qf).relu()
        out[:, b:b + block_I] = torch.where(valid, (s * wf[:, None, :]).sum(-1), -math.inf)
    return out


def bwd_model(q, k, w, indices, dscores, block_I=64, normalize=True):
    """The backward's arithmetic on the CPU, in its order: the row's max|dscores| (valid slots)
    and max|w|; per block of slots S in fp32, dw += dscores · ReLU(S), the operands
    Gq = ŝ · [S > 0] and Gk = ŵ · [S > 0] rounded to the data dtype, dq += Gqᵀ · K, the block's
    dk rows Gk · Q times dscores · max|w| scattered into fp32; dq times max|dscores| · w at the
    end.  ``normalize=False``: the unnormalized operand ``dscores · w · [S > 0]`` rounded to the
    data dtype for both products instead (what the kernel avoids).  Returns dq_idx in the data
    dtype, dk_idx and dw in fp32."""
    dtype = q.dtype
    T = q.shape[0]
    qf, kf, wf = q.float(), k.float(), w.float()
    idx_all = indices.long()
    valid_all = (idx_all >= 0) & (idx_all < T)
    ds_all = torch.where(valid_all, dscores.float(), 0.0)
    big_ds = ds_all.abs().amax(1) if ds_all.shape[1] else torch.zeros(T)
    big_w = wf.abs().amax(1)
    normal = torch.finfo(torch.float32).tiny  # the kernel normalizes by normal maxima only
    inv_ds = torch.where(big_ds >= normal, 1 / big_ds, 0.0)
    inv_w = torch.where(big_w >= normal, 1 / big_w, 0.0)
    dq = torch.zeros(q.shape)
    dk = torch.zeros(k.shape)
    dw = torch.zeros(w.shape)
    for b in range(0, indices.shape[1], block_I):
        idx, valid = idx_all[:, b:b + block_I], valid_all[:, b:b + block_I]
        ds = ds_all[:, b:b + block_I]
        rows = kf[torch.where(valid, idx, 0)] * valid[..., None]
        s = torch.einsum("tjd,thd->tjh", rows, qf)
        pos = s > 0
        dw += torch.einsum("tj,tjh->th", ds, s.relu())
        if normalize:
            gq = torch.where(pos, (ds * inv_ds[:, None])[..., None], 0.0).to(dtype).float()
            gk = torch.where(pos, (wf * inv_w[:, None])[:, None, :], 0.0).to(dtype).float()
            dq += torch.einsum("tjh,tjd->thd", gq, rows)
            rows_dk = torch.einsum("tjh,thd->tjd", gk, qf) * (ds * big_w[:, None])[..., None]
        else:
            g = torch.where(pos, ds[..., None] * wf[:, None, :], 0.0).to(dtype).float()
            dq += torch.einsum("tjh,tjd->thd", g, rows)
            rows_dk = torch.einsum("tjh,thd->tjd", g, qf)
        dk.index_add_(0, idx[valid], rows_dk[valid])
    if normalize:
        dq *= (wf * big_ds[:, None])[..., None]
    return dq.to(dtype), dk, dw


def pipeline_schedule(n_blocks: int, stages: int):
    """The kernels' gather schedule, as their code issues it: q's commit group first, one
    group per prologue block (empty past the last block), then per iteration i a barrier, the
    gather of block i + stages - 1 into buffer (i + stages - 1) % stages (if it exists), one
    commit (empty past the last block), ``wait_group(stages - 1)``, a barrier, the compute of
    block i from buffer i % stages.  Asserts at every compute that q's and block i's groups
    are complete and that block i is the buffer's content; at every gather, that the buffer's
    previous block was computed in an earlier iteration (before the barrier).  Returns the
    groups committed."""
    groups = ["q"]
    holds = {}  # buffer -> the block last gathered into it
    computed = set()
    for b in range(stages - 1):
        if b < n_blocks:
            holds[b % stages] = b
        groups.append(b if b < n_blocks else None)
    for i in range(n_blocks):
        ahead = i + stages - 1
        if ahead < n_blocks:
            buf = ahead % stages
            assert holds.get(buf) is None or holds[buf] in computed, (i, buf)
            holds[buf] = ahead
        groups.append(ahead if ahead < n_blocks else None)
        complete = groups[:len(groups) - (stages - 1)]
        assert "q" in complete and i in complete, (n_blocks, stages, i)
        assert holds[i % stages] == i
        computed.add(i)
    return groups


# ---------------------------------------------------------------- no GPU: configs


def test_variants_are_few_distinct_and_valid():
    """Four variants a family ((64, 128) and (32, 64) x bf16 / fp16), eight in all; the
    backward builds the forward's configs and shares its rule."""
    fwd, bwd = list(ifwd.variants()), list(ibwd.variants())
    assert fwd == bwd and len(fwd) + len(bwd) == 8
    for factory, every in ((FWD, fwd), (BWD, bwd)):
        assert len({tlc.cache_key(factory, c) for c in every}) == len(every)
    for c in fwd:
        ifwd._check_config(c["H"], c["D"], c["dtype"], 64, 2, 128)
        ibwd._check_config(c["H"], c["D"], c["dtype"], 64, 2, 256)
    assert DEEPSEEK in ifwd.DIMS and ibwd.config_for is ifwd.config_for


def test_shared_memory_keeps_a_margin():
    """At DeepSeek dims the forward takes about 49 KiB (four CTAs per SM), the backward about
    98 KiB (two); every built config stays clear of the sm_90 limit by the margin."""
    for H, D in ifwd.DIMS:
        assert ifwd.smem_bytes(H, D) + ifwd._SMEM_MARGIN <= ifwd._SMEM_LIMIT
        assert ibwd.smem_bytes(H, D) + ibwd._SMEM_MARGIN <= ibwd._SMEM_LIMIT
    assert 4 * (ifwd.smem_bytes(*DEEPSEEK) + 1024) <= 228 * 1024
    assert 2 * (ibwd.smem_bytes(*DEEPSEEK) + 1024) <= 228 * 1024


@pytest.mark.parametrize("factory", [FWD, BWD], ids=["fwd", "bwd"])
@pytest.mark.parametrize("bad", [
    dict(dtype="float32"), dict(dtype="int32"), dict(H=24), dict(H=256), dict(D=96),
    dict(D=32), dict(D=320), dict(block_I=32), dict(num_stages=4), dict(threads=512),
    dict(block_I=128, threads=128, H=128),  # the S tile alone: 128 registers a thread
])
def test_bad_config_raises(factory, bad):
    good = dict(H=64, D=128, dtype="bfloat16")
    with pytest.raises(ValueError):
        factory(**(good | bad))


def test_config_for_names_a_variant_or_none():
    every = list(ifwd.variants())
    for (H, D), dtype in zip(ifwd.DIMS * 2, (BF16, BF16, FP16, FP16)):
        assert ifwd.config_for(H, D, dtype) in every
    for H, D, dtype in [(64, 128, torch.float32), (64, 128, torch.float64), (16, 128, BF16),
                        (64, 64, BF16), (2, 16, FP16)]:
        assert ifwd.config_for(H, D, dtype) is None


def test_module_families_follow_the_conventions():
    """``csrc_tl.<name>`` with ``<name>_kernel`` and ``variants()``, listed in
    ``csrc_tl.DSA_KERNEL_MODULES`` (so precompile builds them)."""
    import csrc_tl

    for family, factory in FAMILIES.items():
        module = importlib.import_module(f"csrc_tl.{family}")
        assert getattr(module, f"{family}_kernel") is factory and list(module.variants())
        assert family in csrc_tl.DSA_KERNEL_MODULES


# ---------------------------------------------------------------- no GPU: the algorithms


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_pipeline_schedule_waits_for_the_right_groups(stages):
    """Every iteration commits one group, so ``wait_group(stages - 1)`` always covers block i
    (and q), and no gather overwrites a buffer before its block was computed; k = 0 leaves
    groups that only the final ``wait_group(0)`` drains."""
    for n_blocks in range(0, 7):
        groups = pipeline_schedule(n_blocks, stages)
        assert len(groups) == 1 + (stages - 1) + n_blocks
        assert [g for g in groups[1:] if g is not None] == list(range(n_blocks))


def test_fwd_model_on_integer_inputs_equals_the_pytorch_kernel():
    """Exact scores: the forward's model equals the op's PyTorch kernel bit for bit, with k not
    a multiple of the slot block, -1 tails and holes, a row of -1, padding rows."""
    T, k = 150, 100
    q, kk, w = integer_inputs(T, *DEEPSEEK, BF16, seed=1)
    idx = causal_indices(T, k, [0, 1, 90, 140], seed=1)
    idx[50] = -1
    want = op.indexer_fwd_reference(q, kk, w, idx)
    for block_I in (64, 128):
        assert torch.equal(fwd_model(q, kk, w, idx, block_I), want)
    assert torch.isneginf(want[140:]).all() and torch.isneginf(want[50]).all()
    assert torch.isfinite(want[100]).any() and torch.isneginf(want[100]).any()  # a -1 tail


def test_fwd_model_counts_out_of_range_slots_as_empty():
    """On CUDA no index is read on the host: a value below -1 or at / past T is an empty slot
    (-inf), like -1."""
    T, k = 40, 30
    q, kk, w = integer_inputs(T, 32, 64, FP16)
    idx = causal_indices(T, k, None, holes=False)
    wild = idx.clone()
    wild[:, ::3] = T + 7
    wild[:, 1::5] = -9
    clean = torch.where((wild >= 0) & (wild < T), wild, -1)
    assert torch.equal(fwd_model(q, kk, w, wild), fwd_model(q, kk, w, clean))
    assert torch.equal(fwd_model(q, kk, w, clean), op.indexer_fwd_reference(q, kk, w, clean))


def test_bwd_model_on_integer_inputs_equals_the_pytorch_kernel():
    """Integer inputs and dyadic dscores: the normalized operands and every sum are exact, so
    the backward's model equals the op's PyTorch kernel bit for bit (dq_idx and dk_idx after
    the same rounding to bf16); dscores at -1 slots are NaN and change nothing."""
    T, k = 160, 100
    q, kk, w = integer_inputs(T, *DEEPSEEK, BF16, seed=2)
    idx = causal_indices(T, k, [0, 1, 100, 150], seed=2)
    ds = with_nan_at_invalid(dyadic_dscores(T, k, seed=2), idx)
    want = op.indexer_bwd_reference(q, kk, w, idx, ds)
    dq, dk, dw = bwd_model(q, kk, w, idx, ds)
    assert torch.equal(dq, want[0]) and torch.equal(dk.to(BF16), want[1])
    assert torch.equal(dw, want[2])


@pytest.mark.parametrize("ds_scale", [1.0, 1e-3], ids=["unit", "small"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_bwd_model_meets_the_bars(dtype, ds_scale):
    """With the kernel's roundings (normalized operands in the data dtype), dq_idx, dk_idx and
    dw stay within half their bar at DeepSeek dims (k 192 of 160 tokens' keys, -1 tails and
    holes, a row without a valid slot, padding rows), for unit dscores and for small ones
    (1e-3: dscores · w near 1e-5, below fp16's normal range)."""
    T, k = 160, 192
    q, kk, w = random_inputs(T, *DEEPSEEK, dtype, seed=3)
    idx = causal_indices(T, k, [0, 1, 120, 150], seed=3)
    idx[60] = -1
    ds = with_nan_at_invalid(random_dscores(T, k, ds_scale, seed=3), idx)
    dq, dk, dw = bwd_model(q, kk, w, idx, ds)
    grad_parity((dq, dk.to(dtype), dw), reference_bwd(q, kk, w, idx, ds), idx, dtype,
                f"CPU model ds x{ds_scale:g}", bar_scale=0.5)


def test_unnormalized_fp16_operands_would_fail_the_bar():
    """Why the operands are normalized: with small dscores, ``dscores · w`` rounded to fp16
    lands among the subnormals, and dq_idx / dk_idx miss the fp16 bar (by about 1.5x); the
    normalized operands (previous test) meet half of it."""
    T, k = 160, 192
    q, kk, w = random_inputs(T, *DEEPSEEK, FP16, seed=3)
    idx = causal_indices(T, k, [0, 1, 120, 150], seed=3)
    ds = random_dscores(T, k, 1e-3, seed=3)
    dq, dk, _ = bwd_model(q, kk, w, idx, ds, normalize=False)
    want = reference_bwd(q, kk, w, idx, ds)
    bar = TOLERANCES[FP16]["grad"]
    assert rms_ratio(dq, want[0]) > bar and rms_ratio(dk, want[1]) > bar


# ---------------------------------------------------------------- no GPU: the ops' CUDA functions


def meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.fixture
def cuda_body(monkeypatch):
    """The ops' CUDA functions made runnable on any tensors, as on an sm_90 GPU (the kernels
    are on by default): each kernel is a stand-in that checks the launch's arguments against the traced
    kernel, that q_idx and k_idx are 16-byte aligned and that dk_idx's accumulator starts at
    zero; on CPU tensors it then runs the kernel's CPU model into the outputs.  Yields the
    (family, config) pairs asked for."""
    asked = []

    def checking_kernel_for(family, config):
        asked.append((family, config))
        check = launch_checker(FAMILIES[family], config)

        def launch_fwd(q, k, w, indices, scores):
            assert q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0
            check(q, k, w, indices, scores)
            if not q.is_meta:
                scores.copy_(fwd_model(q, k, w, indices))

        def launch_bwd(q, k, w, indices, dscores, dq, dk, dw):
            assert q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0
            assert dk.is_meta or not dk.any()
            check(q, k, w, indices, dscores, dq, dk, dw)
            if not q.is_meta:
                for out, value in zip((dq, dk, dw), bwd_model(q, k, w, indices, dscores)):
                    out.copy_(value)

        return launch_fwd if family == "dsa_indexer_fwd" else launch_bwd

    monkeypatch.setattr(op, "tilelang_usable", lambda device: True)
    monkeypatch.setattr(op, "kernel_for", checking_kernel_for)
    monkeypatch.delenv(op.INDEXER_KERNEL_SWITCH, raising=False)  # on by default
    return asked


@pytest.mark.parametrize("w_dtype", [torch.float32, BF16, torch.float64], ids=dtype_id)
@pytest.mark.parametrize("dims", ifwd.DIMS, ids=lambda d: f"H{d[0]}-D{d[1]}")
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_cuda_bodies_launch_the_kernels_reading_no_value(cuda_body, dims, dtype, w_dtype):
    """Meta tensors have no values: any host read of one (a sync on the GPU) would raise."""
    H, D = dims
    q, k, w = meta(9, H, D, dtype=dtype), meta(9, D, dtype=dtype), meta(9, H, dtype=w_dtype)
    idx = meta(9, 2048, dtype=torch.int32)
    scores = op.indexer_fwd_cuda(q, k, w, idx)
    assert scores.shape == (9, 2048) and scores.dtype == torch.float32
    dq, dk, dw = op.indexer_bwd_cuda(q, k, w, idx, meta(9, 2048, dtype=torch.float32))
    assert (dq.shape, dq.dtype, dk.shape, dk.dtype) == ((9, H, D), dtype, (9, D), dtype)
    assert dw.shape == (9, H) and dw.dtype == w_dtype
    config = ifwd.config_for(H, D, dtype)
    assert cuda_body == [("dsa_indexer_fwd", config), ("dsa_indexer_bwd", config)]


@pytest.mark.parametrize("w_dtype", [torch.float32, BF16, torch.float64], ids=dtype_id)
def test_cuda_bodies_prepare_the_launch_and_finish_the_outputs(cuda_body, w_dtype):
    """On CPU tensors through the kernels' models: scores equal the PyTorch kernel's (exact
    inputs); dq_idx, dk_idx (the fp32 accumulator, cast) and dw (fp32, then w's dtype) equal the
    PyTorch backward's; the launch got views that start mid-row aligned."""
    T, k = 40, 70
    q, kk, w = integer_inputs(T, 32, 64, FP16, seed=4)
    q_mid = torch.empty(q.numel() + 1, dtype=FP16)[1:].view(q.shape).copy_(q)  # 2 bytes in
    w = w.to(w_dtype)
    idx = causal_indices(T, k, [0, 30, 35], seed=4)
    ds = with_nan_at_invalid(dyadic_dscores(T, k, seed=4), idx)
    assert torch.equal(op.indexer_fwd_cuda(q_mid, kk, w, idx),
                       op.indexer_fwd_reference(q, kk, w, idx))
    got = op.indexer_bwd_cuda(q_mid, kk, w, idx, ds)
    want = op.indexer_bwd_reference(q, kk, w, idx, ds)
    assert [g.dtype for g in got] == [FP16, FP16, w_dtype]
    assert all(torch.equal(g, r) for g, r in zip(got, want))
    assert [f for f, _ in cuda_body] == ["dsa_indexer_fwd", "dsa_indexer_bwd"]


FALLBACKS = {  # case: (q_idx [T, H, D, dtype], k_idx dtype, indices [k, dtype])
    "fp32": ((5, 64, 128, torch.float32), torch.float32, (4, torch.int32)),
    "fp64": ((5, 64, 128, torch.float64), torch.float64, (4, torch.int32)),
    "k_idx dtype": ((5, 64, 128, BF16), FP16, (4, torch.int32)),
    "int64 indices": ((5, 64, 128, BF16), BF16, (4, torch.int64)),
    "dims not built": ((5, 16, 32, BF16), BF16, (4, torch.int32)),
    "no slot": ((5, 64, 128, BF16), BF16, (0, torch.int32)),
    "no token": ((0, 64, 128, BF16), BF16, (4, torch.int32)),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_cuda_bodies_fall_back_to_the_pytorch_kernels(cuda_body, case):
    (T, H, D, dt), k_dt, (k, idx_dt) = FALLBACKS[case]
    q, kk, w = random_inputs(T, H, D, dt)
    kk = kk.to(k_dt)
    idx = causal_indices(T, k, None).to(idx_dt) if T else torch.empty(0, k, dtype=idx_dt)
    ds = random_dscores(T, k)
    assert torch.equal(op.indexer_fwd_cuda(q, kk, w, idx), op.indexer_fwd_reference(q, kk, w, idx))
    got = op.indexer_bwd_cuda(q, kk, w, idx, ds)
    want = op.indexer_bwd_reference(q, kk, w, idx, ds)
    assert all(torch.equal(g, r) for g, r in zip(got, want))
    assert cuda_body == []


def test_cuda_bodies_keep_the_pytorch_kernels_when_switched_off(cuda_body, monkeypatch):
    monkeypatch.setenv(op.INDEXER_KERNEL_SWITCH, "0")
    q, kk, w = random_inputs(30, 64, 128, BF16)
    idx = causal_indices(30, 12, None)
    assert torch.equal(op.indexer_fwd_cuda(q, kk, w, idx), op.indexer_fwd_reference(q, kk, w, idx))
    op.indexer_bwd_cuda(q, kk, w, idx, random_dscores(30, 12))
    assert cuda_body == []


def test_cuda_bodies_obey_the_disable_switch(monkeypatch):
    """``TORCH_DPLR_DISABLE_TILELANG=1`` keeps the PyTorch kernels."""
    def no_kernel(*args):
        raise AssertionError("a kernel was asked for")

    monkeypatch.setenv("TORCH_DPLR_DISABLE_TILELANG", "1")
    monkeypatch.delenv(op.INDEXER_KERNEL_SWITCH, raising=False)  # on by default
    monkeypatch.setattr(op, "kernel_for", no_kernel)
    q, kk, w = random_inputs(30, 64, 128, BF16)
    idx = causal_indices(30, 12, None)
    assert torch.equal(op.indexer_fwd_cuda(q, kk, w, idx), op.indexer_fwd_reference(q, kk, w, idx))
    op.indexer_bwd_cuda(q, kk, w, idx, random_dscores(30, 12))


def test_sanitizer_driver_runs_every_indexer_variant():
    """tools/sanitize_kernels.py's indexer cases pick every variant of both families."""
    import pathlib
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "sanitize_kernels.py"
    spec = importlib.util.spec_from_file_location("sanitize_kernels", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert [ifwd.config_for(H, D, getattr(torch, dt)) for H, D, dt in tool.INDEXER_CASES] == \
        list(ifwd.variants())


# ---------------------------------------------------------------- nvcc, no GPU


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found")
@pytest.mark.parametrize("family", FAMILIES)
def test_every_variant_compiles(cold_cache, family):
    """Every variant compiled for sm_90a into an empty cache (prints each compile time):
    cp.async gathers, wgmma for the scores, the backward's 16-byte atomics, no TMA descriptors,
    and every size but the dims symbolic (one build serves every T and k)."""
    from tvm import tirx

    factory = FAMILIES[family]
    configs = list(importlib.import_module(f"csrc_tl.{family}").variants())
    lines = []
    tlc.build_all([(factory, c) for c in configs], progress=lines.append, load=False)
    print("\n".join(lines))
    done = [line for line in lines if line.startswith("[")]
    assert len(done) == len(configs) and not any("FAILED" in line for line in done), lines
    for config in configs:
        kernel = tlc.build(factory, **config)
        src = kernel.get_kernel_source()
        assert "__global__" in src and "cp_async" in src and "wgmma_ss" in src, config
        assert "CUtensorMap" not in src, config
        if family == "dsa_indexer_bwd":
            assert "AtomicAddx4" in src and "warp_reduce_max" in src, config
        names = {str(d) for p in kernel.params for d in p.shape if isinstance(d, tirx.Var)}
        for size in ("T", "K"):
            assert any(n == size or n.startswith(size + "_") for n in names), (config, names)


# ---------------------------------------------------------------- GPU

SCHEDULES = [dict(block_I=128), dict(num_stages=1), dict(num_stages=3),
             dict(threads=256), dict(block_I=128, threads=256)]
BWD_SCHEDULES = [dict(block_I=128), dict(num_stages=1), dict(num_stages=3), dict(threads=128)]
SMALL = dict(H=32, D=64, dtype="float16")


@pytest.fixture(scope="module")
def gpu_kernels():
    """Every kernel the GPU tests launch, compiled up front (from TILELANG_CACHE_DIR when it was
    filled before)."""
    if torch.cuda.get_device_capability() != (9, 0):  # the kernels are built for sm_90a only
        pytest.skip("needs an sm_90 GPU (H100 / H200)")
    items = [(f, c) for f in (FWD, BWD) for c in ifwd.variants()]
    items += [(FWD, SMALL | s) for s in SCHEDULES] + [(BWD, SMALL | s) for s in BWD_SCHEDULES]
    tlc.build_all(items, progress=print, load=False)


gpu = pytest.mark.usefixtures("ieee_fp32_matmul", "gpu_kernels")


@pytest.fixture
def tilelang_only(monkeypatch):
    """Through the ops, a fall back to a PyTorch kernel fails the test."""
    def forbidden(*args):
        raise AssertionError("a dsa indexer op fell back to its PyTorch kernel")

    monkeypatch.delenv("TORCH_DPLR_DISABLE_TILELANG", raising=False)
    monkeypatch.delenv(op.INDEXER_KERNEL_SWITCH, raising=False)  # on by default
    monkeypatch.setattr(op, "indexer_fwd_reference", forbidden)
    monkeypatch.setattr(op, "indexer_bwd_reference", forbidden)


def run_fwd(q, k, w, indices, **schedule):
    """The compiled forward called directly, scores pre-filled with NaN."""
    kernel = tlc.build(FWD, **ifwd.config_for(q.shape[1], q.shape[2], q.dtype) | schedule)
    scores = torch.full(indices.shape, NAN, device=q.device)
    kernel(q.contiguous(), k.contiguous(), w.float().contiguous(), indices.contiguous(), scores)
    torch.cuda.synchronize()
    return scores


def run_bwd(q, k, w, indices, dscores, **schedule):
    """The compiled backward called directly: dq_idx and dw pre-filled with NaN, dk_idx's fp32
    accumulator zeroed.  Returns ``(dq_idx, dk_idx in the data dtype, dw, the accumulator)``."""
    kernel = tlc.build(BWD, **ifwd.config_for(q.shape[1], q.shape[2], q.dtype) | schedule)
    dq = torch.full(q.shape, NAN, dtype=q.dtype, device=q.device)
    acc = torch.zeros(k.shape, device=q.device)
    dw = torch.full(w.shape, NAN, device=q.device)
    kernel(q.contiguous(), k.contiguous(), w.float().contiguous(), indices.contiguous(),
           dscores.float().contiguous(), dq, acc, dw)
    torch.cuda.synchronize()
    return dq, acc.to(k.dtype), dw, acc


def time_ms(fn, reps=10):
    from benchmarks.timing import Timer

    return Timer("cuda", reps=reps, cap_s=10.0).measure(fn).ms


# T 8192 as a 1-token, a 3071-token, an empty, a 4000-token and a 1000-token sequence, then a
# 120-token padding tail (rows without a slot)
DEEPSEEK_CU = [0, 1, 3072, 3072, 7072, 8072]
DEEPSEEK_T, DEEPSEEK_K = 8192, 2048


def deepseek_indices():
    return causal_indices(DEEPSEEK_T, DEEPSEEK_K, DEEPSEEK_CU, device="cuda")


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_ops_exact_on_integer_inputs_at_deepseek_sizes(tilelang_only, dtype):
    """Exact sums (integer inputs, dyadic dscores, NaN at -1 slots): through the ops at T 8192
    packed, H_idx 64, D_idx 128, k 2048, the CUDA kernels equal the PyTorch kernels bit for bit:
    scores, dq_idx, dk_idx (whatever the order of its atomics) and dw."""
    q, k, w = integer_inputs(DEEPSEEK_T, *DEEPSEEK, dtype, device="cuda")
    idx = deepseek_indices()
    ds = with_nan_at_invalid(dyadic_dscores(DEEPSEEK_T, DEEPSEEK_K, device="cuda"), idx)
    assert torch.equal(torch.ops.dsa.indexer_fwd(q, k, w, idx), reference_fwd(q, k, w, idx))
    got = torch.ops.dsa.indexer_bwd(q, k, w, idx, ds)
    want = reference_bwd(q, k, w, idx, ds)
    assert torch.equal(got[0], want[0].to(dtype)) and torch.equal(got[1], want[1].to(dtype))
    assert torch.equal(got[2], want[2])


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("ds_scale", [1.0, 1e-3], ids=["unit", "small"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_ops_at_deepseek_sizes(tilelang_only, dtype, ds_scale):
    """Random DeepSeek-like inputs through the ops: scores at fp32 round-off, gradients within
    the bars (also with small dscores, where fp16 needs the normalized operands); prints the
    errors and the ops' times against the PyTorch kernels' (benchmarks/dsa.py measures them)."""
    q, k, w = random_inputs(DEEPSEEK_T, *DEEPSEEK, dtype, device="cuda")
    idx = deepseek_indices()
    ds = with_nan_at_invalid(random_dscores(DEEPSEEK_T, DEEPSEEK_K, ds_scale, device="cuda"), idx)
    label = f"T{DEEPSEEK_T} k{DEEPSEEK_K} ds x{ds_scale:g}"
    score_parity(torch.ops.dsa.indexer_fwd(q, k, w, idx), reference_fwd(q, k, w, idx), label)
    grads = torch.ops.dsa.indexer_bwd(q, k, w, idx, ds)
    grad_parity(grads, reference_bwd(q, k, w, idx, ds), idx, dtype, label)
    if ds_scale == 1.0:
        fwd_ms = time_ms(lambda: torch.ops.dsa.indexer_fwd(q, k, w, idx))
        bwd_ms = time_ms(lambda: torch.ops.dsa.indexer_bwd(q, k, w, idx, ds))
        ref_fwd = time_ms(lambda: reference_fwd(q, k, w, idx), reps=3)
        ref_bwd = time_ms(lambda: reference_bwd(q, k, w, idx, ds), reps=3)
        macs = DEEPSEEK_T * DEEPSEEK_K * DEEPSEEK[0] * DEEPSEEK[1]
        print(f"  fwd {fwd_ms:.3f} ms ({2 * macs / fwd_ms / 1e9:.0f} TFLOP/s), PyTorch "
              f"{ref_fwd:.1f} ms; bwd {bwd_ms:.3f} ms ({6 * macs / bwd_ms / 1e9:.0f} TFLOP/s), "
              f"PyTorch {ref_bwd:.1f} ms")


VARIANT_CU = [0, 1, 130, 131, 280]  # a 1-token, a 129-token, an empty, a 149-token sequence,
#                                     then a 20-token padding tail


def variant_id(config):
    return f"H{config['H']}-D{config['D']}-{config['dtype']}"


def small_case(config, k, seed):
    T = 300
    dtype = getattr(torch, config["dtype"])
    q, kk, w = random_inputs(T, config["H"], config["D"], dtype, seed=seed, device="cuda")
    idx = causal_indices(T, k, VARIANT_CU, seed=seed, device="cuda")
    idx[200] = -1
    wild = idx.clone()  # out of range: an empty slot, never read
    wild[::9, 2::17] = T + 5
    wild[1::9, 3::19] = -4
    clean = torch.where((wild >= 0) & (wild < T), wild, -1)
    ds = random_dscores(T, k, seed=seed, device="cuda")
    ds = torch.where(clean >= 0, ds, NAN)
    return q, kk, w, wild, clean, ds


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("k", [1, 63, 64, 65, 100, 400])
@pytest.mark.parametrize("config", list(ifwd.variants()), ids=variant_id)
def test_every_variant(config, k):
    """Every variant at small sizes by direct calls (outputs pre-filled with NaN): k from 1 past
    the longest sequence, -1 tails and holes, a row of -1, out-of-range slots, padding rows, NaN
    dscores at every invalid slot."""
    q, kk, w, wild, clean, ds = small_case(config, k, seed=k)
    dtype = q.dtype
    score_parity(run_fwd(q, kk, w, wild), reference_fwd(q, kk, w, clean), variant_id(config))
    dq, dk, dw, _ = run_bwd(q, kk, w, wild, ds)
    grad_parity((dq, dk, dw), reference_bwd(q, kk, w, clean, ds), clean, dtype,
                f"{variant_id(config)} k{k}")


@pytest.mark.cuda
@gpu
def test_padding_rows_get_zero_gradients():
    """Tokens with no valid slot: scores all -inf, dq_idx and dw exact zeros."""
    q, kk, w, wild, clean, ds = small_case(SMALL, 100, seed=1)
    empty = ~(clean >= 0).any(1)
    assert empty.sum() >= 21
    assert torch.isneginf(run_fwd(q, kk, w, wild)[empty]).all()
    dq, _, dw, _ = run_bwd(q, kk, w, wild, ds)
    assert (dq[empty] == 0).all() and (dw[empty] == 0).all()


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_fwd_schedule_knobs(schedule):
    q, kk, w, wild, clean, _ = small_case(SMALL, 300, seed=2)
    score_parity(run_fwd(q, kk, w, wild, **schedule), reference_fwd(q, kk, w, clean), str(schedule))


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("schedule", BWD_SCHEDULES,
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_bwd_schedule_knobs(schedule):
    q, kk, w, wild, clean, ds = small_case(SMALL, 300, seed=3)
    dq, dk, dw, _ = run_bwd(q, kk, w, wild, ds, **schedule)
    grad_parity((dq, dk, dw), reference_bwd(q, kk, w, clean, ds), clean, q.dtype, str(schedule))


@pytest.mark.cuda
@gpu
def test_dq_dw_deterministic_and_dk_within_reordering_error():
    """Two runs: dq_idx and dw identical (each CTA owns its token's rows), dk_idx's fp32
    accumulator equal up to the order of its atomic adds (a key here takes the terms of up to
    ~1000 tokens)."""
    T, k = 2048, 512
    q, kk, w = random_inputs(T, *DEEPSEEK, BF16, device="cuda")
    idx = causal_indices(T, k, None, device="cuda")
    ds = random_dscores(T, k, device="cuda")
    dq1, _, dw1, acc1 = run_bwd(q, kk, w, idx, ds)
    dq2, _, dw2, acc2 = run_bwd(q, kk, w, idx, ds)
    assert torch.equal(dq1, dq2) and torch.equal(dw1, dw2)
    # a reordered fp32 sum of n terms moves by at most (n - 1) · 2^-24 · Σ|terms| (first
    # order); n <= T here, and RMS(acc) stands in for Σ|terms| (no larger)
    diff = rms_ratio(acc1, acc2)
    print(f"dk_idx run to run: {diff:.2e} (RMS ratio)")
    assert diff <= 2 * T * 2.0 ** -24


@pytest.mark.cuda
@gpu
def test_non_finite_inputs_match_the_pytorch_kernel():
    """inf entries in q_idx and k_idx: scores of +-inf and NaN where the reference has them
    (ReLU keeps NaN, as torch.relu)."""
    T, k = 200, 64
    q, kk, w = integer_inputs(T, *DEEPSEEK, BF16, seed=6, device="cuda")
    q[::7, :, 3] = float("inf")
    q[1::11, 0, :] = -float("inf")
    kk[::13, 5] = float("inf")
    idx = causal_indices(T, k, None, seed=6, device="cuda")
    got, want = run_fwd(q, kk, w, idx), reference_fwd(q, kk, w, idx)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])


@pytest.mark.cuda
@gpu
def test_ops_replay_in_a_cuda_graph(tilelang_only):
    """The ops' CUDA paths sync nothing: forward and backward capture into one CUDA graph (once
    their kernels are loaded) and the replay is right."""
    T, k = 700, 96
    q, kk, w = integer_inputs(T, *DEEPSEEK, BF16, device="cuda")
    idx = causal_indices(T, k, [0, 300, 650], device="cuda")
    ds = dyadic_dscores(T, k, device="cuda")
    torch.ops.dsa.indexer_fwd(q, kk, w, idx)  # loads the kernels outside the capture
    torch.ops.dsa.indexer_bwd(q, kk, w, idx, ds)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scores = torch.ops.dsa.indexer_fwd(q, kk, w, idx)
        grads = torch.ops.dsa.indexer_bwd(q, kk, w, idx, ds)
    for x in (scores, *grads):
        x.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(scores, reference_fwd(q, kk, w, idx))
    want = reference_bwd(q, kk, w, idx, ds)
    assert all(torch.equal(g, r.to(g.dtype)) for g, r in zip(grads, want))


@pytest.mark.cuda
def test_ops_keep_the_pytorch_kernels_elsewhere(monkeypatch):
    """fp32 inputs and dims without a variant run the PyTorch kernels on the GPU too."""
    monkeypatch.delenv(op.INDEXER_KERNEL_SWITCH, raising=False)  # on by default
    for H, D, dtype in [(64, 128, torch.float32), (8, 16, BF16)]:
        q, kk, w = random_inputs(50, H, D, dtype, device="cuda")
        idx = causal_indices(50, 9, [0, 20, 50], device="cuda")
        ds = random_dscores(50, 9, device="cuda")
        assert torch.equal(torch.ops.dsa.indexer_fwd(q, kk, w, idx),
                           op.indexer_fwd_reference(q, kk, w, idx))
        with deterministic_algorithms():
            got = torch.ops.dsa.indexer_bwd(q, kk, w, idx, ds)
            want = op.indexer_bwd_reference(q, kk, w, idx, ds)
        assert all(torch.equal(g, r) for g, r in zip(got, want))
