"""The TileLang sparse MLA forward (csrc_tl/dsa_sparse_mla_fwd.py), the CUDA kernel of
``dsa::sparse_mla_fwd``, against the op's PyTorch kernel.

* No GPU: config checks; the op's CUDA function run on meta / CPU tensors with the kernel
  replaced by a check of its arguments against the traced kernel (``csrc_tl.launch_check``):
  which calls take the kernel, that the decision and the launch read no tensor value (meta
  tensors have none), the fallbacks; a CPU model of the kernel's roundings (P rounded to the
  data dtype for the P · V product) against the bars.
* nvcc, no GPU: every variant of every DSA kernel family (``csrc_tl.DSA_KERNEL_MODULES``: this
  forward and the backward) compiled for sm_90a into an empty TileLang cache; the precompile
  step and the sanitizer driver cover them.
* GPU (marker ``cuda``): o and lse against ``torch_dplr.dsa.reference.sparse_mla.sparse_mla_fwd``
  run in fp32, o taken before its rounding to the input dtype (the bars of
  ``torch_dplr.dsa.testing.TOLERANCES`` are against an unrounded reference): through the op at
  DeepSeek-V3.2 sizes (T 4096 as packed sequences with a padding tail, H 16 / 64 / 128, k 2048,
  D 576 / 512) with the PyTorch fallback forbidden, and by direct calls of every variant at
  small sizes with padded head blocks, -1 slots, rows without a valid key, k not a multiple of
  the slot block, other schedules; direct calls' outputs are pre-filled with NaN so an
  unwritten entry shows up.  Errors and the DeepSeek cases' times are printed (``pytest -s``).
"""
from __future__ import annotations

import importlib
import importlib.util
import itertools
import math

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

import csrc_tl  # noqa: E402
from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import dsa_sparse_mla_fwd as smla  # noqa: E402
from csrc_tl.launch_check import launch_checker  # noqa: E402
from torch_dplr.dsa.ops import sparse_mla as op  # noqa: E402
from torch_dplr.dsa.reference import sparse_mla as ref  # noqa: E402
from torch_dplr.dsa.testing import TOLERANCES, visible_mask  # noqa: E402
from torch_dplr.testing import rms_ratio  # noqa: E402

try:  # the compile test's empty-cache fixture; importing it skips without nvcc
    from test_tl_compile import cold_cache  # noqa: F401, E402  (a fixture)
    HAVE_NVCC = True
except pytest.skip.Exception:
    HAVE_NVCC = False

BF16, FP16 = torch.bfloat16, torch.float16
FACTORY = smla.dsa_sparse_mla_fwd_kernel
DEEPSEEK = (576, 512)  # D_qk (512 latent + 64 rope), d_v
dtype_id = lambda d: str(d).removeprefix("torch.")  # noqa: E731


# ---------------------------------------------------------------- inputs and the reference


def causal_indices(T, k, cu_seqlens, *, seed=0, device="cpu", holes=True):
    """``[T, k]`` int32: per token up to k distinct keys among those it sees (causal within its
    sequence; padding tokens see none), in random order, -1 in the slots left over; with
    ``holes`` some rows also lose slots in the middle."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(T, T, generator=gen, device=device)
    scores.masked_fill_(~visible_mask(T, cu_seqlens, device), -1.0)
    values, idx = scores.topk(min(k, T), dim=1)
    idx = torch.where(values >= 0, idx, -1)
    if idx.shape[1] < k:
        idx = torch.cat([idx, idx.new_full((T, k - idx.shape[1]), -1)], dim=1)
    if holes:
        idx[::5, 1::3] = -1
    return idx.to(torch.int32).contiguous()


def random_inputs(T, H, D_qk, dtype, *, T_kv=None, seed=0, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, D_qk, generator=gen, device=device).to(dtype)
    kv = torch.randn(T if T_kv is None else T_kv, D_qk, generator=gen, device=device).to(dtype)
    return q, kv


def reference(q, kv, indices, scale, d_v):
    """The op's PyTorch kernel in fp32: ``(o before its rounding to q's dtype, lse)``."""
    T, H, D_qk = q.shape
    o = torch.empty(T, H, d_v, device=q.device)
    lse = torch.empty(T, H, device=q.device)
    ref.sparse_mla_fwd(q.float(), kv.float(), indices, float(scale), d_v, o, lse,
                       ref.block_rows(indices.shape[1], H, D_qk))
    return o, lse


def parity(o, lse, o_ref, lse_ref, dtype, label=""):
    """Assert the kernel's outputs match the reference within the DSA bars; returns the errors."""
    tol = TOLERANCES[dtype]
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(o).all(), "non-finite (or unwritten) o"
    assert not (torch.isnan(lse) | torch.isposinf(lse)).any(), "NaN / +inf (or unwritten) lse"
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty), "lse is -inf on other rows than the reference's"
    assert (o[empty] == 0).all(), "a row without a valid slot must give o = 0"
    errors = dict(o=rms_ratio(o, o_ref), lse=rms_ratio(lse[~empty], lse_ref[~empty]))
    print(f"{label} {dtype_id(dtype)}: o {errors['o']:.2e} (bar {tol['o']:.0e}), "
          f"lse {errors['lse']:.2e} (bar {tol['lse']:.0e}), "
          f"{int(empty.all(1).sum())} of {empty.shape[0]} tokens without a valid slot")
    assert errors["o"] <= tol["o"] and errors["lse"] <= tol["lse"], errors
    return errors


# ---------------------------------------------------------------- no GPU


def test_block_heads_pads_to_the_smallest_block():
    assert [smla.block_heads(H) for H in (1, 16, 17, 32, 33, 64, 96, 128)] == \
        [16, 16, 32, 32, 64, 64, 64, 64]


def test_shared_memory_keeps_a_margin():
    """At D_qk 576 with 64 heads per CTA two buffers of 64 slots would use the whole sm_90
    limit (TileLang lays them out in exactly 232,448 B): that config is refused and the default
    takes 32 slots; every other built config keeps 64."""
    with pytest.raises(ValueError, match="shared memory"):
        FACTORY(D_qk=576, d_v=512, dtype="bfloat16", block_H=64, block_I=64)
    assert smla.block_slots(576, 64) == 32
    assert smla.smem_bytes(576, 64, 32, 2) + smla._SMEM_MARGIN <= smla._SMEM_LIMIT
    assert {smla.block_slots(D_qk, hb) for (D_qk, _), hb in
            itertools.product(smla.DIMS, smla.HEAD_BLOCKS) if (D_qk, hb) != (576, 64)} == {64}
    FACTORY(D_qk=576, d_v=512, dtype="bfloat16")  # the defaults are accepted


def test_variants_are_distinct_and_valid():
    every = list(smla.variants())
    assert len({tlc.cache_key(FACTORY, c) for c in every}) == len(every)
    for c in every:  # the factory's checks, without tracing
        smla._check_config(c["D_qk"], c["d_v"], c["dtype"], c["block_H"],
                           smla.block_slots(c["D_qk"], c["block_H"]), 2, 256)
    assert {(c["D_qk"], c["d_v"]) for c in every} == set(smla.DIMS) and DEEPSEEK in smla.DIMS


@pytest.mark.parametrize("bad", [
    dict(dtype="float32"), dict(dtype="int32"), dict(d_v=96), dict(D_qk=500), dict(D_qk=528),
    dict(block_H=48), dict(block_I=128), dict(num_stages=3), dict(threads=512),
    dict(threads=128),  # the 64 x 512 fp32 O tile in one warpgroup: 256 registers a thread
    dict(D_qk=640, block_I=64),  # 64 x 640 q plus two 64 x 640 kv buffers: over 227 KiB
    dict(block_I=64),  # at D_qk 576: exactly the 227 KiB limit, no margin
    dict(d_v=128, D_qk=192, block_H=16, block_I=32),  # 16 x 32 S tile over 8 warps: no partition
])
def test_bad_config_raises(bad):
    good = dict(D_qk=576, d_v=512, dtype="bfloat16", block_H=64)
    with pytest.raises(ValueError):
        FACTORY(**(good | bad))


def test_config_for_names_a_variant_or_none():
    every = list(smla.variants())
    for (D_qk, d_v), dtype, H in itertools.product(smla.DIMS, (BF16, FP16), (1, 16, 20, 64, 128)):
        assert smla.config_for(D_qk, d_v, H, dtype) in every
    assert smla.config_for(576, 512, 128, BF16)["block_H"] == 64
    for D_qk, d_v, dtype in [(576, 512, torch.float32), (576, 512, torch.float64),
                             (576, 256, BF16), (40, 32, BF16), (128, 128, FP16)]:
        assert smla.config_for(D_qk, d_v, 16, dtype) is None


def test_dsa_sources_do_not_key_the_dplr_kernels():
    """The disk cache's markers hash the kernel's own module plus csrc_tl's shared files; a DSA
    kernel file is not one of them, so editing it leaves every DPLR kernel cached."""
    import csrc_tl

    shared = {path.rsplit("/", 1)[-1] for path in tlc._shared_sources()}
    assert "compile.py" in shared
    assert not shared & {f"{name}.py" for name in (*csrc_tl.KERNEL_MODULES,
                                                     *csrc_tl.DSA_KERNEL_MODULES)}


@pytest.fixture
def cuda_body(monkeypatch):
    """The op's CUDA function made runnable on any tensors, as on an sm_90 GPU: its kernel is a
    stand-in that checks the launch's arguments against the traced kernel and that q and kv are
    16-byte aligned, and launches nothing.  Yields the configs asked for."""
    asked = []

    def checking_kernel_for(family, config):
        assert family == "dsa_sparse_mla_fwd"
        asked.append(config)
        check = launch_checker(FACTORY, config)

        def launch(q, kv, *rest):
            assert q.data_ptr() % 16 == 0 and kv.data_ptr() % 16 == 0
            check(q, kv, *rest)
        return launch

    monkeypatch.setattr(op, "tilelang_usable", lambda device: True)
    monkeypatch.setattr(op, "kernel_for", checking_kernel_for)
    # this kernel at every head count (tests/test_tl_dsa_sparse_mla_ws.py: which calls take
    # the warp-specialized schedule)
    monkeypatch.setenv(op.FWD_WS_SWITCH, "0")
    return asked


def meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("H", [16, 20, 64, 96, 128])
@pytest.mark.parametrize("dims", smla.DIMS, ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_cuda_body_launches_the_kernel_reading_no_value(cuda_body, H, dims, dtype):
    """Meta tensors have no values: any host read of one (a sync on the GPU) would raise."""
    D_qk, d_v = dims
    o, lse = op.sparse_mla_fwd_cuda(meta(7, H, D_qk, dtype=dtype), meta(11, D_qk, dtype=dtype),
                                    meta(7, 2048, dtype=torch.int32), 0.1, d_v)
    assert o.shape == (7, H, d_v) and o.dtype == dtype
    assert lse.shape == (7, H) and lse.dtype == torch.float32
    assert cuda_body == [smla.config_for(D_qk, d_v, H, dtype)]


def test_cuda_body_aligns_a_view_that_starts_mid_row(cuda_body):
    q = torch.randn(3 * 4 * 64 + 1).to(BF16)[1:].view(3, 4, 64)  # 2 bytes into its storage
    kv = torch.randn(5, 64).to(BF16)
    op.sparse_mla_fwd_cuda(q, kv, torch.zeros(3, 2, dtype=torch.int32), 0.1, 64)
    assert len(cuda_body) == 1


FALLBACKS = {  # case: (q, kv, indices, d_v)
    "fp32": ((5, 3, 64, torch.float32), (6, 64, torch.float32), (5, 4, torch.int32), 64),
    "fp64": ((5, 3, 64, torch.float64), (6, 64, torch.float64), (5, 4, torch.int32), 64),
    "kv dtype": ((5, 3, 64, BF16), (6, 64, FP16), (5, 4, torch.int32), 64),
    "int64 indices": ((5, 3, 64, BF16), (6, 64, BF16), (5, 4, torch.int64), 64),
    "dims not built": ((5, 3, 40, BF16), (6, 40, BF16), (5, 4, torch.int32), 32),
    "d_v not built": ((5, 3, 576, BF16), (6, 576, BF16), (5, 4, torch.int32), 256),
    "no slot": ((5, 3, 64, BF16), (6, 64, BF16), (5, 0, torch.int32), 64),
    "no token": ((0, 3, 64, BF16), (0, 64, BF16), (0, 4, torch.int32), 64),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_cuda_body_falls_back_to_the_pytorch_kernel(cuda_body, case):
    (T, H, D_qk, dt), (T_kv, _, kv_dt), (_, k, idx_dt), d_v = FALLBACKS[case]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D_qk, generator=gen).to(dt)
    kv = torch.randn(T_kv, D_qk, generator=gen).to(kv_dt)
    idx = torch.randint(-1, T_kv, (T, k), generator=gen).to(idx_dt)
    o, lse = op.sparse_mla_fwd_cuda(q, kv, idx, 0.1, d_v)
    want = op.sparse_mla_fwd_reference(q, kv, idx, 0.1, d_v)
    assert cuda_body == []
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])


def test_cuda_body_obeys_the_disable_switch(monkeypatch):
    """``TORCH_DPLR_DISABLE_TILELANG=1`` (the DPLR ops' switch) keeps the PyTorch kernel."""
    def no_kernel(*args):
        raise AssertionError("a kernel was asked for")

    monkeypatch.setenv("TORCH_DPLR_DISABLE_TILELANG", "1")
    monkeypatch.setattr(op, "kernel_for", no_kernel)
    q, kv = random_inputs(5, 3, 64, BF16)
    idx = causal_indices(5, 4, None)
    o, lse = op.sparse_mla_fwd_cuda(q, kv, idx, 0.1, 64)
    assert torch.equal(o, op.sparse_mla_fwd_reference(q, kv, idx, 0.1, 64)[0])


def test_a_kernel_that_cannot_be_built_leaves_the_pytorch_kernel(monkeypatch):
    """No nvcc, a TileLang error: one warning, then None (the op falls back) without retrying."""
    import csrc_tl
    from torch_dplr.dsa.ops import kernels

    def broken(*args, **kwargs):
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(csrc_tl, "build_all", broken)
    monkeypatch.setattr(kernels, "_kernels", {})
    config = smla.config_for(64, 64, 16, BF16)
    with pytest.warns(RuntimeWarning, match="nvcc not found"):
        assert kernels.kernel_for("dsa_sparse_mla_fwd", config) is None
    monkeypatch.setattr(csrc_tl, "build_all", None)  # a retry would call it
    assert kernels.kernel_for("dsa_sparse_mla_fwd", config) is None


def kernel_model(q, kv, indices, scale, d_v, block_I=64):
    """The kernel's arithmetic on the CPU, in its order: blocks of slots, log2-unit online
    softmax from the lowest finite max, P rounded to the data dtype for P · V (l sums fp32 P),
    zero rows for invalid slots, o rounded once."""
    dtype = q.dtype
    qf, kvf = q.float(), kv.float()
    T, H = q.shape[:2]
    c = scale * math.log2(math.e)
    m = torch.full((T, H), torch.finfo(torch.float32).min)
    l, acc = torch.zeros(T, H), torch.zeros(T, H, d_v)
    for b in range(0, indices.shape[1], block_I):
        idx = indices[:, b:b + block_I].long()
        valid = (idx >= 0) & (idx < kv.shape[0])
        rows = kvf[torch.where(valid, idx, 0)] * valid[..., None]
        s = torch.einsum("thd,tkd->thk", qf, rows) * c
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(s - m_new[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("thk,tkd->thd", p.to(dtype).float(),
                                                    rows[..., :d_v])
        m = m_new
    o = torch.where(l[..., None] > 0, acc / l[..., None], 0.0).to(dtype)
    lse = torch.where(l > 0, (m + torch.log2(l)) * math.log(2.0), float("-inf"))
    return o, lse


@pytest.mark.parametrize("block_I", [32, 64])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_rounding_model_meets_the_bars(dtype, block_I):
    """With the kernel's one extra rounding (P in the data dtype) o stays near half its bar at
    DeepSeek dims (2,048 slots of random keys, -1 tails and holes, an empty row)."""
    T, T_kv, H, k = 48, 4096, 8, 2048
    q, kv = random_inputs(T, H, DEEPSEEK[0], dtype, T_kv=T_kv, seed=1)
    gen = torch.Generator().manual_seed(2)
    idx = torch.stack([torch.randperm(T_kv, generator=gen)[:k] for _ in range(T)]).int()
    idx[::3, 1000:] = -1
    idx[::5, 7::11] = -1
    idx[4] = -1
    o_ref, lse_ref = reference(q, kv, idx, DEEPSEEK[0] ** -0.5, DEEPSEEK[1])
    o, lse = kernel_model(q, kv, idx, DEEPSEEK[0] ** -0.5, DEEPSEEK[1], block_I)
    errors = parity(o, lse, o_ref, lse_ref, dtype, "CPU model")
    assert errors["o"] <= 0.6 * TOLERANCES[dtype]["o"]


# ---------------------------------------------------------------- nvcc, no GPU


SOURCE_CHECKS = {  # family: what its kernel source must show, beyond what every one must
    # wgmma where a CTA's 64 heads fill a warpgroup's M, mma.sync below
    "dsa_sparse_mla_fwd": lambda src, c: ("wgmma_ss" in src) == (c["block_H"] == 64)
    != ("mma_sync" in src),
    # three warpgroups: registers moved between them, the gather completing on mbarriers
    "dsa_sparse_mla_fwd_ws": lambda src, c: "wgmma_ss" in src and "warpgroup_reg_alloc" in src
    and "mbarrier_cp_async_arrive_noinc" in src,
    # products with an M of 64 are wgmma (the heads' at 64 heads per CTA, dkv's at 64 slots per
    # block), the others mma.sync; dkv added with 16-byte fp32 atomics
    "dsa_sparse_mla_bwd": lambda src, c: "wgmma_ss" in src and "AtomicAddx4" in src
    and ("mma_sync" in src) == (min(c["block_H"], _bwd_slots(c)) < 64),
}


def _bwd_slots(config):
    from csrc_tl import dsa_sparse_mla_bwd

    return dsa_sparse_mla_bwd.block_slots(config["D_qk"], config["d_v"], config["block_H"])


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found")
@pytest.mark.parametrize("family", [f for f in csrc_tl.DSA_KERNEL_MODULES
                                    if f.startswith("dsa_sparse_mla")])
def test_every_variant_compiles(cold_cache, family):
    """Every variant of the sparse MLA kernel families, compiled for sm_90a into an empty
    cache; prints each kernel's compile time (tests/test_tl_dsa_indexer_topk.py compiles the
    indexer's)."""
    from tvm import tirx

    module = importlib.import_module(f"csrc_tl.{family}")
    factory = getattr(module, f"{family}_kernel")
    configs = list(module.variants())
    lines = []
    tlc.build_all([(factory, c) for c in configs], progress=lines.append, load=False)
    print("\n".join(lines))
    done = [line for line in lines if line.startswith("[")]
    assert len(done) == len(configs) and not any("FAILED" in line for line in done), lines
    assert all(tlc.on_disk(factory, **c) for c in configs)
    for config in configs:  # every kernel loads from the cache the workers filled
        kernel = tlc.build(factory, **config)
        src = kernel.get_kernel_source()
        assert "__global__" in src and "cp_async" in src, config
        assert "CUtensorMap" not in src, config  # no TMA descriptors encoded per launch
        assert SOURCE_CHECKS.get(family, lambda *_: True)(src, config), config
        # every size but the dims is symbolic: one build serves every T, T_kv, H and k
        names = {str(d) for p in kernel.params for d in p.shape if isinstance(d, tirx.Var)}
        for size in ("T", "T_kv", "H", "K"):
            assert any(n == size or n.startswith(size + "_") for n in names), (config, names)


@pytest.mark.parametrize("family", ["all", "dsa", "dplr"])
def test_precompile_builds_the_dsa_variants(monkeypatch, family):
    """``python -m torch_dplr precompile`` compiles every DSA variant with the DPLR ones
    (``--family`` picks one list), never for a DPLR configuration."""
    from torch_dplr import precompile

    built = []
    monkeypatch.setattr(csrc_tl, "build_all", lambda items, **kw: built.extend(items))
    assert precompile.main(["--family", family]) == 0
    dsa = list(csrc_tl.every_variant(csrc_tl.DSA_KERNEL_MODULES))
    dplr = list(csrc_tl.every_variant())
    assert built == dict(all=dplr + dsa, dsa=dsa, dplr=dplr)[family]
    built.clear()
    assert precompile.main(["--chunk-size", "64", "--head-dim", "64"]) == 0
    assert built and not any(f.__module__.startswith("csrc_tl.dsa_") for f, _ in built)
    with pytest.raises(SystemExit):  # a DPLR configuration with the DSA family
        precompile.main(["--chunk-size", "64", "--head-dim", "64", "--family", "dsa"])


def test_sanitizer_driver_runs_every_dsa_variant():
    """tools/sanitize_kernels.py runs the sparse MLA forward's variants forward and backward:
    the backward builds exactly those, and the driver's head counts pick each one."""
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "sanitize_kernels.py"
    spec = importlib.util.spec_from_file_location("sanitize_kernels", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    every = list(smla.variants())
    assert list(importlib.import_module("csrc_tl.dsa_sparse_mla_bwd").variants()) == every
    for c in every:
        H = tool.DSA_HEADS[c["block_H"]]
        assert smla.config_for(c["D_qk"], c["d_v"], H, getattr(torch, c["dtype"])) == c


# ---------------------------------------------------------------- GPU

SCHEDULES = [dict(block_I=32), dict(num_stages=1), dict(threads=128),
             dict(block_I=32, num_stages=1, threads=128)]
SMALL_SCHEDULE_CONFIG = dict(D_qk=192, d_v=128, dtype="float16", block_H=32)
# DeepSeek dims at 64 heads per CTA: the default (32 slots, two stages) and 64 slots unstaged
DEEPSEEK_SCHEDULES = [dict(), dict(block_I=64, num_stages=1)]


@pytest.fixture(scope="module")
def gpu_kernels():
    """Every kernel the GPU tests launch, compiled up front by parallel processes (one by one,
    on first use, they would take minutes); from TILELANG_CACHE_DIR when it was filled before."""
    if torch.cuda.get_device_capability() != (9, 0):  # the kernels are built for sm_90a only
        pytest.skip("needs an sm_90 GPU (H100 / H200)")
    configs = list(smla.variants()) + [SMALL_SCHEDULE_CONFIG | s for s in SCHEDULES]
    configs += [smla.config_for(*DEEPSEEK, 128, BF16) | s for s in DEEPSEEK_SCHEDULES[1:]]
    tlc.build_all([(FACTORY, c) for c in configs], progress=print, load=False)


gpu = pytest.mark.usefixtures("ieee_fp32_matmul", "gpu_kernels")


@pytest.fixture
def tilelang_only(monkeypatch):
    """Through the op, a fall back to the PyTorch kernel fails the test."""
    def forbidden(*args):
        raise AssertionError("dsa::sparse_mla_fwd fell back to its PyTorch kernel")

    monkeypatch.delenv("TORCH_DPLR_DISABLE_TILELANG", raising=False)
    monkeypatch.setattr(op, "sparse_mla_fwd_reference", forbidden)


def run_prefilled(q, kv, indices, scale, d_v, **schedule):
    """The compiled kernel called directly, outputs pre-filled with NaN."""
    config = smla.config_for(q.shape[2], d_v, q.shape[1], q.dtype) | schedule
    kernel = tlc.build(FACTORY, **config)
    o = torch.full((q.shape[0], q.shape[1], d_v), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    kernel(q, kv, indices, float(scale), o, lse)
    torch.cuda.synchronize()
    return o, lse


def deepseek_case(H, dtype):
    """T 4096 packed as a 1-token, a 1535-token, an empty and a 2464-token sequence plus a
    96-token padding tail (rows without a key), k 2048."""
    T, k = 4096, 2048
    q, kv = random_inputs(T, H, DEEPSEEK[0], dtype, device="cuda")
    idx = causal_indices(T, k, [0, 1, 1536, 1536, 4000], device="cuda")
    return q, kv, idx, DEEPSEEK[0] ** -0.5


def time_ms(fn):
    from benchmarks.timing import Timer

    return Timer("cuda", reps=10, cap_s=5.0).measure(fn).ms


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_op_at_deepseek_sizes(tilelang_only, H, dtype):
    """Through ``torch.ops.dsa.sparse_mla_fwd`` (the TileLang path: the fallback is forbidden);
    prints the kernel's time."""
    q, kv, idx, scale = deepseek_case(H, dtype)
    d_v = DEEPSEEK[1]
    o, lse = torch.ops.dsa.sparse_mla_fwd(q, kv, idx, scale, d_v)
    parity(o, lse, *reference(q, kv, idx, scale, d_v), dtype, f"T4096 H{H} k2048")
    ms = time_ms(lambda: torch.ops.dsa.sparse_mla_fwd(q, kv, idx, scale, d_v))
    flops = 2 * q.shape[0] * H * idx.shape[1] * sum(DEEPSEEK)  # every slot, valid or not
    print(f"  {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s over all slots")


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("schedule", DEEPSEEK_SCHEDULES,
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()) or "default")
def test_deepseek_schedules(schedule):
    """The default at D 576 / 64 heads per CTA (32 slots, two stages) against 64 slots without
    prefetch, H 128 bf16: same results up to summation order; prints both times."""
    q, kv, idx, scale = deepseek_case(128, BF16)
    o, lse = run_prefilled(q, kv, idx, scale, DEEPSEEK[1], **schedule)
    parity(o, lse, *reference(q, kv, idx, scale, DEEPSEEK[1]), BF16, str(schedule))
    kernel = tlc.build(FACTORY, **smla.config_for(*DEEPSEEK, 128, BF16) | schedule)
    print(f"  {time_ms(lambda: kernel(q, kv, idx, scale, o, lse)):.3f} ms")


# a head count per head block: a full block, a padded one, a full 64 and a padded second 64
VARIANT_HEADS = {16: 16, 32: 20, 64: 96}


def variant_id(config):
    return f"{config['D_qk']}-{config['d_v']}-{config['dtype']}-H{VARIANT_HEADS[config['block_H']]}"


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("config", list(smla.variants()), ids=variant_id)
def test_every_variant(config):
    """Every variant the op can pick, at small sizes (the compute-sanitizer target): padded
    head blocks, a 1-token sequence, a padding tail, k = 100 (not a multiple of the slot
    block), -1 tails, holes and an explicit row of -1."""
    T, k, H = 300, 100, VARIANT_HEADS[config["block_H"]]
    D_qk, d_v, dtype = config["D_qk"], config["d_v"], getattr(torch, config["dtype"])
    assert smla.config_for(D_qk, d_v, H, dtype) == config
    q, kv = random_inputs(T, H, D_qk, dtype, seed=H, device="cuda")
    idx = causal_indices(T, k, [0, 1, 130, 280], seed=H, device="cuda")
    idx[200] = -1
    scale = 0.7 * D_qk ** -0.5
    o, lse = run_prefilled(q, kv, idx, scale, d_v)
    parity(o, lse, *reference(q, kv, idx, scale, d_v), dtype, variant_id(config))


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("k", [1, 5, 64, 65])
def test_few_slots_and_a_longer_kv(k):
    """k below, at and just past one slot block; kv with more rows than q (T_kv != T)."""
    T, T_kv, H = 37, 500, 16
    D_qk, d_v = 192, 128
    q, kv = random_inputs(T, H, D_qk, BF16, T_kv=T_kv, seed=k, device="cuda")
    gen = torch.Generator().manual_seed(k)
    # distinct keys per row (the contract), -1 among them at random places
    idx = torch.stack([torch.randperm(T_kv + 1, generator=gen)[:k] - 1 for _ in range(T)])
    idx = idx.to(device="cuda", dtype=torch.int32)
    o, lse = run_prefilled(q, kv, idx, D_qk ** -0.5, d_v)
    parity(o, lse, *reference(q, kv, idx, D_qk ** -0.5, d_v), BF16, f"k{k}")


@pytest.mark.cuda
@gpu
def test_out_of_range_indices_count_as_empty_slots(tilelang_only):
    """On CUDA the op does not read the indices on the host: values below -1 or at / past
    T_kv never read outside kv, they are empty slots, like -1."""
    T, H, k = 64, 16, 96
    q, kv = random_inputs(T, H, 64, BF16, device="cuda")
    idx = causal_indices(T, k, None, device="cuda", holes=False)
    wild = idx.clone()
    wild[:, ::4] = T + 1000
    wild[:, 1::4] = -7
    clean = torch.where((wild >= 0) & (wild < T), wild, -1)
    o, lse = torch.ops.dsa.sparse_mla_fwd(q, kv, wild, 0.125, 64)
    parity(o, lse, *reference(q, kv, clean, 0.125, 64), BF16, "out of range")


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("schedule", SCHEDULES,
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_schedule_knobs(schedule):
    """Other schedules give the same results up to summation order (the bars)."""
    T, H, k = 200, 20, 150
    D_qk, d_v = SMALL_SCHEDULE_CONFIG["D_qk"], SMALL_SCHEDULE_CONFIG["d_v"]
    q, kv = random_inputs(T, H, D_qk, FP16, device="cuda")
    idx = causal_indices(T, k, [0, 120, 190], device="cuda")
    o, lse = run_prefilled(q, kv, idx, D_qk ** -0.5, d_v, **schedule)
    parity(o, lse, *reference(q, kv, idx, D_qk ** -0.5, d_v), FP16, str(schedule))


@pytest.mark.cuda
@gpu
def test_op_replays_in_a_cuda_graph(tilelang_only):
    """The op's CUDA path syncs nothing: it captures into a CUDA graph (once its kernel is
    loaded) and the replay is right."""
    T, H, k = 256, 20, 80
    q, kv = random_inputs(T, H, 192, BF16, device="cuda")
    idx = causal_indices(T, k, [0, 100, 256], device="cuda")
    torch.ops.dsa.sparse_mla_fwd(q, kv, idx, 0.1, 128)  # loads the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = torch.ops.dsa.sparse_mla_fwd(q, kv, idx, 0.1, 128)
    o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    parity(o, lse, *reference(q, kv, idx, 0.1, 128), BF16, "graph replay")


@pytest.mark.cuda
def test_op_keeps_the_pytorch_kernel_elsewhere():
    """fp32 data and dims without a variant run the PyTorch kernel on the GPU too."""
    for D_qk, d_v, dtype in [(64, 64, torch.float32), (40, 32, BF16)]:
        q, kv = random_inputs(50, 3, D_qk, dtype, device="cuda")
        idx = causal_indices(50, 9, None, device="cuda")
        o, lse = torch.ops.dsa.sparse_mla_fwd(q, kv, idx, 0.2, d_v)
        want = op.sparse_mla_fwd_reference(q, kv, idx, 0.2, d_v)
        assert torch.equal(o, want[0]) and torch.equal(lse, want[1])
