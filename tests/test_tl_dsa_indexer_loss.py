"""The TileLang KL-loss kernel (``csrc_tl/dsa_indexer_loss.py``) and ``dsa::indexer_loss_fwd``'s
CUDA function.

* Any machine: the variants and their shared memory, bad configs; the kernel's contract written
  row by row (:func:`kernel_model`) against the op's PyTorch kernel (in-range indices, -1 tails,
  rows without a valid slot, -inf scores); the CUDA function run on meta / CPU tensors with the
  kernel replaced by a check of its arguments against the traced kernel (which calls take it,
  that the decision and the launch read no tensor value, the switch, the fallbacks) and, on CPU
  tensors, by the model, so the op's own reduction of the rows is checked end to end.
* nvcc, no GPU: every variant compiled for sm_90a into an empty TileLang cache.
* GPU (marker ``cuda``): the kernel against the PyTorch kernel at every variant's dims, packed
  sequences with -1 tails and empty rows; slots past ``T_kv``; non-finite scores; a CUDA graph
  replay.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import dsa_indexer_loss as kl  # noqa: E402
from csrc_tl.launch_check import launch_checker  # noqa: E402
from test_tl_dsa_sparse_mla import causal_indices, dtype_id, meta  # noqa: E402
from torch_dplr.dsa.ops import loss as op  # noqa: E402
from torch_dplr.dsa.testing import forbid_pytorch_kernels  # noqa: E402

try:  # the compile test's empty-cache fixture; importing it skips without nvcc
    from test_tl_compile import cold_cache  # noqa: F401, E402  (a fixture)
    HAVE_NVCC = True
except pytest.skip.Exception:
    HAVE_NVCC = False

BF16, FP16 = torch.bfloat16, torch.float16
FACTORY = kl.dsa_indexer_loss_kernel


def make_inputs(T, H, D_qk, k, dtype, *, cu=(0,), T_kv=None, seed=0, device="cpu"):
    """scores, q, kv, indices, lse: top-k style indices (-1 tails, padding rows without a
    slot), lse the log-sum-exp of each head's logits over the row's valid slots (-inf: none)."""
    T_kv = T if T_kv is None else T_kv
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, D_qk, generator=gen, device=device).to(dtype)
    kv = torch.randn(T_kv, D_qk, generator=gen, device=device).to(dtype)
    indices = causal_indices(T, k, list(cu) + [T] if len(cu) == 1 else list(cu), seed=seed,
                             device=device)
    scores = torch.randn(T, indices.shape[1], generator=gen, device=device) * 3
    lse = logsumexp_over_slots(q, kv, indices, D_qk ** -0.5)
    return scores, q, kv, indices, lse


def logsumexp_over_slots(q, kv, indices, scale):
    idx = indices.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    logits = torch.einsum("thd,tkd->thk", q.float(), kv.float()[idx.clamp(0, kv.shape[0] - 1)])
    logits = (logits * scale).masked_fill(~valid[:, None, :], float("-inf"))
    return torch.logsumexp(logits, dim=-1)


def kernel_model(scores, q, kv, indices, lse, scale):
    """The kernel's contract in fp64, row by row: ``(target, rows)``.  A slot is valid when its
    index lies in ``[0, T_kv)`` (another is an empty slot, as in the other DSA kernels); ``p``
    and the scores' softmax run over the valid slots; ``rows[t] = (KL[t], row t has a valid
    slot)``."""
    T, H = q.shape[:2]
    target = torch.zeros(indices.shape, dtype=torch.float64)
    rows = torch.zeros(T, 2, dtype=torch.float64)
    for t in range(T):
        idx = indices[t].long().cpu()
        valid = (idx >= 0) & (idx < kv.shape[0])
        if valid.any():
            keys = kv[idx[valid]].cpu().double()
            logits = scale * q[t].cpu().double() @ keys.T
            u = torch.exp(logits - lse[t].cpu().double()[:, None]).sum(0) / H
            target[t, valid] = u / max(float(u.sum()), kl.EPS)
            s = scores[t].cpu().double()[valid]
            finite = s[s > float("-inf")]
            m = float(finite.max()) if finite.numel() else 0.0
            log_z = math.log(max(float(torch.exp(s - m).sum()), torch.finfo(torch.float32).tiny))
            p = target[t, valid]
            rows[t, 0] = (p * (torch.log(p.clamp(min=kl.EPS)) - (s - m - log_z))).sum()
            rows[t, 1] = 1
    return target, rows


def model_loss(rows, coeff, reduction):
    total = rows[:, 0].sum()
    return coeff * (total / rows[:, 1].sum().clamp(min=1) if reduction == "mean" else total)


# ---------------------------------------------------------------- no GPU


def test_config_for_pads_the_heads_and_names_only_built_variants():
    built = list(kl.variants())
    assert kl.config_for(576, 20, BF16) == dict(D_qk=576, dtype="bfloat16", heads=64)
    assert kl.config_for(576, 65, FP16) == dict(D_qk=576, dtype="float16", heads=128)
    assert kl.config_for(64, 1, BF16) == dict(D_qk=64, dtype="bfloat16", heads=128)
    for D_qk, H, dtype in [(128, 16, BF16), (576, 129, BF16), (576, 16, torch.float32)]:
        assert kl.config_for(D_qk, H, dtype) is None
    for D_qk, heads in kl.HEADS.items():
        for H in (1, heads[-1]):
            for dtype in (BF16, FP16):
                assert kl.config_for(D_qk, H, dtype) in built


def test_shared_memory_keeps_a_margin():
    for config in kl.variants():
        schedule = kl.default_schedule(config["D_qk"], config["heads"])
        used = kl.smem_bytes(config["D_qk"], config["heads"], schedule["block_I"],
                             schedule["num_stages"])
        assert used + kl._SMEM_MARGIN <= kl._SMEM_LIMIT, (config, used)


@pytest.mark.parametrize("bad", [dict(dtype="float32"), dict(D_qk=100), dict(heads=32),
                                 dict(block_I=32), dict(num_stages=3), dict(threads=128),
                                 dict(chunk=100), dict(D_qk=1024, num_stages=2)])
def test_bad_config_raises(bad):
    with pytest.raises(ValueError):
        FACTORY(**{**dict(D_qk=576, dtype="bfloat16", heads=128), **bad})


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_model_is_the_pytorch_kernel(reduction):
    """In-range indices: the contract row by row equals the op's PyTorch kernel (fp32), with
    -1 tails, a one-token sequence and padding rows without a slot."""
    scores, q, kv, idx, lse = make_inputs(60, 5, 32, 40, torch.float32, cu=(0, 30, 31, 55))
    target, rows = kernel_model(scores, q, kv, idx, lse, 32 ** -0.5)
    loss, target_ref = op.indexer_loss_fwd_reference(scores, q, kv, idx, lse, 32 ** -0.5, 0.3,
                                                     reduction)
    assert rows[55:, 1].sum() == 0 and rows[:55, 1].sum() == 55
    torch.testing.assert_close(target.float(), target_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model_loss(rows, 0.3, reduction).float(), loss, rtol=1e-5,
                               atol=1e-6)


def test_model_gives_the_pytorch_kernels_infinities():
    """A valid slot with a -inf score, and a row whose valid scores are all -inf: the log of
    the indexer's probability is -inf where the target is positive, so the loss is +inf in both
    (no NaN from -inf - -inf)."""
    scores, q, kv, idx, lse = make_inputs(20, 2, 16, 8, torch.float32)
    scores[5, 0] = float("-inf")
    scores[9] = float("-inf")
    _, rows = kernel_model(scores, q, kv, idx, lse, 0.25)
    loss, _ = op.indexer_loss_fwd_reference(scores, q, kv, idx, lse, 0.25, 1.0, "sum")
    assert torch.isposinf(loss)
    assert torch.isposinf(rows[5, 0]) and torch.isposinf(rows[9, 0])
    assert torch.isfinite(rows[[0, 1, 2, 3, 4, 6, 7, 8], 0]).all()


def test_model_treats_slots_past_kv_as_empty():
    """An index at or past T_kv is an empty slot even with a -inf score (what the score
    kernel writes there): the same target and rows as a -1 in its place."""
    scores, q, kv, idx, lse = make_inputs(20, 2, 16, 8, torch.float32)
    past, empty = idx.clone(), idx.clone()
    past[4, 0], empty[4, 0] = 25, -1
    scores_past = scores.clone()
    scores_past[4, 0] = float("-inf")
    lse = logsumexp_over_slots(q, kv, empty, 0.25)
    got = kernel_model(scores_past, q, kv, past, lse, 0.25)
    want = kernel_model(scores, q, kv, empty, lse, 0.25)
    assert torch.isfinite(got[1]).all()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.fixture
def cuda_body(monkeypatch):
    """The op's CUDA function made runnable on any tensors, as on an sm_90 GPU: the kernel is
    a stand-in that checks the launch's arguments against the traced kernel and that q and kv
    are 16-byte aligned; on CPU tensors it then writes the model's outputs.  Yields the configs
    asked for."""
    asked = []

    def checking_kernel_for(family, config):
        assert family == "dsa_indexer_loss"
        asked.append(config)
        check = launch_checker(FACTORY, config)

        def launch(q, kv, indices, lse, scores, scale, target, rows):
            assert q.data_ptr() % 16 == 0 and kv.data_ptr() % 16 == 0
            check(q, kv, indices, lse, scores, scale, target, rows)
            if not q.is_meta:
                want_target, want_rows = kernel_model(scores, q, kv, indices, lse, scale)
                target.copy_(want_target)
                rows.copy_(want_rows)

        return launch

    monkeypatch.setattr(op, "tilelang_usable", lambda device: True)
    monkeypatch.setattr(op, "kernel_for", checking_kernel_for)
    monkeypatch.delenv(op.LOSS_KERNEL_SWITCH, raising=False)
    return asked


@pytest.mark.parametrize("scores_dtype", [torch.float32, BF16], ids=dtype_id)
@pytest.mark.parametrize("D_qk,H", [(576, 128), (576, 20), (192, 128), (64, 3)])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_cuda_body_launches_the_kernel_reading_no_value(cuda_body, D_qk, H, dtype,
                                                        scores_dtype):
    """Meta tensors have no values: any host read of one (a sync on the GPU) would raise."""
    T, k = 9, 2048
    loss, target = op.indexer_loss_fwd_cuda(meta(T, k, dtype=scores_dtype), meta(T, H, D_qk,
                                            dtype=dtype), meta(11, D_qk, dtype=dtype),
                                            meta(T, k, dtype=torch.int32),
                                            meta(T, H, dtype=torch.float32), 0.1, 0.5, "mean")
    assert loss.shape == () and target.shape == (T, k)
    assert loss.dtype == target.dtype == torch.float32
    assert cuda_body == [kl.config_for(D_qk, H, dtype)]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cuda_body_reduces_the_rows(cuda_body, reduction):
    """On CPU tensors through the model: the op's sum of the kernel's rows is the PyTorch
    kernel's loss; the launch got a q view that starts mid-row aligned."""
    scores, q, kv, idx, lse = make_inputs(70, 20, 64, 150, BF16, cu=(0, 40, 41, 66))
    q_mid = torch.empty(q.numel() + 1, dtype=BF16)[1:].view(q.shape).copy_(q)  # 2 bytes in
    loss, target = op.indexer_loss_fwd_cuda(scores, q_mid, kv, idx, lse, 0.125, 0.7, reduction)
    loss_ref, target_ref = op.indexer_loss_fwd_reference(scores, q, kv, idx, lse, 0.125, 0.7,
                                                         reduction)
    torch.testing.assert_close(target, target_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    assert cuda_body == [kl.config_for(64, 20, BF16)]


def test_cuda_body_keeps_the_pytorch_kernel_when_switched_off(cuda_body, monkeypatch):
    monkeypatch.setenv(op.LOSS_KERNEL_SWITCH, "0")
    scores, q, kv, idx, lse = make_inputs(30, 4, 64, 10, BF16)
    got = op.indexer_loss_fwd_cuda(scores, q, kv, idx, lse, 0.1, 1.0, "mean")
    want = op.indexer_loss_fwd_reference(scores, q, kv, idx, lse, 0.1, 1.0, "mean")
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert cuda_body == []


FALLBACKS = {  # case: (q dtype, kv dtype, D_qk, H, scores dtype, lse dtype, index dtype, T, k)
    "fp32 data": (torch.float32, torch.float32, 64, 4, torch.float32, torch.float32,
                  torch.int32, 20, 8),
    "mixed data": (BF16, FP16, 64, 4, torch.float32, torch.float32, torch.int32, 20, 8),
    "D_qk without a variant": (BF16, BF16, 128, 4, torch.float32, torch.float32, torch.int32,
                               20, 8),
    "too many heads": (BF16, BF16, 64, 129, torch.float32, torch.float32, torch.int32, 20, 8),
    "fp64 scores": (BF16, BF16, 64, 4, torch.float64, torch.float32, torch.int32, 20, 8),
    "bf16 lse": (BF16, BF16, 64, 4, torch.float32, BF16, torch.int32, 20, 8),
    "int64 indices": (BF16, BF16, 64, 4, torch.float32, torch.float32, torch.int64, 20, 8),
    "no slot": (BF16, BF16, 64, 4, torch.float32, torch.float32, torch.int32, 20, 0),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_cuda_body_falls_back_to_the_pytorch_kernel(cuda_body, case):
    q_dt, kv_dt, D_qk, H, s_dt, lse_dt, idx_dt, T, k = FALLBACKS[case]
    scores, q, kv, idx, lse = make_inputs(T, H, D_qk, max(k, 1), torch.float32)
    scores, idx = scores[:, :k].to(s_dt), idx[:, :k].to(idx_dt)
    args = (scores, q.to(q_dt), kv.to(kv_dt), idx, lse.to(lse_dt), 0.1, 1.0, "sum")
    got = op.indexer_loss_fwd_cuda(*args)
    want = op.indexer_loss_fwd_reference(*args)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert cuda_body == []


def test_forbid_pytorch_kernels_catches_a_loss_fallback():
    """The GPU tests' proof that a call ran the kernel covers this op too."""
    scores, q, kv, idx, lse = make_inputs(10, 4, 64, 5, torch.float32)
    with forbid_pytorch_kernels(), pytest.raises(AssertionError, match="GPU kernel was not used"):
        op.indexer_loss_fwd_cuda(scores, q, kv, idx, lse, 0.1, 1.0, "sum")
    op.indexer_loss_fwd_cuda(scores, q, kv, idx, lse, 0.1, 1.0, "sum")  # restored on exit


def test_cuda_body_checks_the_reduction_first(cuda_body):
    scores, q, kv, idx, lse = make_inputs(10, 4, 64, 5, BF16)
    with pytest.raises(ValueError, match="reduction"):
        op.indexer_loss_fwd_cuda(scores, q, kv, idx, lse, 0.1, 1.0, "max")
    assert cuda_body == []


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found")
def test_every_variant_compiles(cold_cache):
    """Every variant compiled for sm_90a into an empty cache (prints each compile time):
    cp.async gathers, wgmma for the logits, no TMA descriptors, no atomics, and every size but
    the dims symbolic (one build serves every T, T_kv, H and k)."""
    from tvm import tirx

    configs = list(kl.variants())
    lines = []
    tlc.build_all([(FACTORY, c) for c in configs], progress=lines.append, load=False)
    print("\n".join(lines))
    done = [line for line in lines if line.startswith("[")]
    assert len(done) == len(configs) and not any("FAILED" in line for line in done), lines
    for config in configs:
        kernel = tlc.build(FACTORY, **config)
        src = kernel.get_kernel_source()
        assert "__global__" in src and "cp_async" in src and "wgmma" in src, config
        assert "CUtensorMap" not in src and "atomicAdd" not in src, config
        names = {str(d) for p in kernel.params for d in p.shape if isinstance(d, tirx.Var)}
        for size in ("T", "T_kv", "H", "K"):
            assert any(n == size or n.startswith(size + "_") for n in names), (config, names)


# ---------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def gpu_kernels():
    """Every variant compiled up front (from TILELANG_CACHE_DIR when it was filled before)."""
    if torch.cuda.get_device_capability() != (9, 0):  # the kernels are built for sm_90a only
        pytest.skip("needs an sm_90 GPU (H100 / H200)")
    tlc.build_all([(FACTORY, c) for c in kl.variants()])


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.delenv(op.LOSS_KERNEL_SWITCH, raising=False)
    monkeypatch.delenv("TORCH_DPLR_DISABLE_TILELANG", raising=False)


def kernel_call(*args):
    """``torch.ops.dsa.indexer_loss_fwd`` with the PyTorch kernels made to fail: proof that the
    call ran the TileLang kernel."""
    with forbid_pytorch_kernels():
        return torch.ops.dsa.indexer_loss_fwd(*args)


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("D_qk,H", [(576, 128), (576, 64), (576, 20), (192, 128), (64, 16)])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_kernel_matches_the_pytorch_kernel(gpu_kernels, kernels_on, D_qk, H, dtype, reduction):
    """Packed sequences (a one-token one, padding rows), k = 200 (blocks of 64 or 128 slots,
    the last partial): target and loss against the PyTorch kernel on the same inputs."""
    scale = D_qk ** -0.5
    scores, q, kv, idx, lse = make_inputs(300, H, D_qk, 200, dtype, cu=(0, 150, 151, 280),
                                          device="cuda")
    loss, target = kernel_call(scores, q, kv, idx, lse, scale, 0.01, reduction)
    loss_ref, target_ref = op.indexer_loss_fwd_reference(scores, q, kv, idx, lse, scale, 0.01,
                                                         reduction)
    torch.testing.assert_close(target, target_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-7)
    assert (target[280:] == 0).all()


@pytest.mark.cuda
def test_slots_past_kv_and_infinite_scores_follow_the_model(gpu_kernels, kernels_on):
    """An index at or past T_kv is an empty slot, whatever its score (the score kernel writes
    -inf there); a -inf score at a valid slot makes its row's KL +inf (the PyTorch kernel's
    answer), never NaN."""
    scores, q, kv, idx, lse = make_inputs(64, 16, 64, 32, BF16, T_kv=64, device="cuda")
    idx[3, 1], idx[7, 0], idx[9, 2] = 64, 10_000, 70
    scores[9, 2] = float("-inf")
    lse = logsumexp_over_slots(q, kv, idx, 0.125)
    loss, target = kernel_call(scores, q, kv, idx, lse, 0.125, 1.0, "sum")
    want_target, want_rows = kernel_model(scores, q, kv, idx, lse, 0.125)
    torch.testing.assert_close(target.cpu().double(), want_target, rtol=1e-4, atol=1e-6)
    assert target[3, 1] == 0 and target[7, 0] == 0 and target[9, 2] == 0
    torch.testing.assert_close(loss.cpu().double(), want_rows[:, 0].sum(), rtol=1e-4, atol=1e-6)
    scores[20, 0] = float("-inf")
    loss, _ = kernel_call(scores, q, kv, idx, lse, 0.125, 1.0, "sum")
    assert torch.isposinf(loss)


@pytest.mark.cuda
def test_rows_longer_than_one_scan_pass(gpu_kernels, kernels_on):
    """k = 2100: the scan and the tail take two strided passes (2048 slots each); two runs give
    the same bits (no atomics, fixed summation order)."""
    scores, q, kv, idx, lse = make_inputs(2200, 16, 64, 2100, BF16, device="cuda")
    loss, target = kernel_call(scores, q, kv, idx, lse, 0.125, 0.01, "mean")
    loss_ref, target_ref = op.indexer_loss_fwd_reference(scores, q, kv, idx, lse, 0.125, 0.01,
                                                         "mean")
    torch.testing.assert_close(target, target_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-7)
    again = kernel_call(scores, q, kv, idx, lse, 0.125, 0.01, "mean")
    assert torch.equal(again[0], loss) and torch.equal(again[1], target)


@pytest.mark.cuda
def test_graph_replay(gpu_kernels, kernels_on):
    scores, q, kv, idx, lse = make_inputs(100, 64, 576, 64, BF16, device="cuda")
    args = (scores, q, kv, idx, lse, 576 ** -0.5, 0.1, "mean")
    want = op.indexer_loss_fwd_reference(*args)
    kernel_call(*args)  # loaded before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, target = kernel_call(*args)
    loss.fill_(float("nan"))
    target.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(target, want[1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, want[0], rtol=1e-4, atol=1e-7)


def test_the_family_is_listed_for_precompile():
    import csrc_tl

    assert "dsa_indexer_loss" in csrc_tl.DSA_KERNEL_MODULES
    module = importlib.import_module("csrc_tl.dsa_indexer_loss")
    assert module.dsa_indexer_loss_kernel is FACTORY
