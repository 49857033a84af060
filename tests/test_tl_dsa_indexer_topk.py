"""The TileLang indexer top-k (csrc_tl/dsa_indexer_topk.py), the CUDA kernel of
``dsa::indexer_topk``, against the op's PyTorch kernel.

* No GPU: config checks; the score keys' order; a CPU model of the kernel's selection (radix
  digits 12 / 12 / 8, settling rows early, the writing pass's tie ranks and slots; the
  threshold search as its threads run it) against the selection rule on the same scores, bit
  for bit: random, heavily tied and non-finite scores, packed sequences, padding, topk from 1
  past T; the model on integer inputs (exact scores) against the op's PyTorch kernel; the
  passes the model makes at DeepSeek-like scores.  The op's CUDA function run on meta / CPU
  tensors with the kernel replaced by a check of its arguments against the traced kernel:
  which calls take the kernel, that the decision and the launch read no tensor value, the
  fallbacks.
* nvcc, no GPU: every variant compiled for sm_90a into an empty TileLang cache (times printed).
* GPU (marker ``cuda``): through the op at DeepSeek sizes (T 8192 packed with a padding tail,
  H_idx 64, D_idx 128, topk 2048) with the fallback forbidden: integer inputs (exact scores,
  many ties) equal to the PyTorch kernel bit for bit; random bf16 / fp16 inputs equal to it but
  for keys whose scores lie within fp32 rounding of their row's k-th score; the time against
  the PyTorch kernel's (at least 5x).  Direct calls of every variant at small sizes (outputs
  pre-filled so an unwritten slot shows up): short and empty rows, topk 1 to past T, all-equal
  scores, non-finite scores; a CUDA graph replay.
"""
from __future__ import annotations

import importlib

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import dsa_indexer_topk as itk  # noqa: E402
from csrc_tl.launch_check import launch_checker  # noqa: E402
from torch_dplr.dsa.ops import topk as op  # noqa: E402
from torch_dplr.dsa.reference import topk as ref  # noqa: E402
from torch_dplr.dsa.reference.layout import key_starts  # noqa: E402

try:  # the compile test's empty-cache fixture; importing it skips without nvcc
    from test_tl_compile import cold_cache  # noqa: F401, E402  (a fixture)
    HAVE_NVCC = True
except pytest.skip.Exception:
    HAVE_NVCC = False

BF16, FP16 = torch.bfloat16, torch.float16
FACTORY = itk.dsa_indexer_topk_kernel
FAMILY = "dsa_indexer_topk"
DEEPSEEK = (64, 128)  # H_idx, D_idx
dtype_id = lambda d: str(d).removeprefix("torch.")  # noqa: E731
INF, NAN = float("inf"), float("nan")


# ---------------------------------------------------------------- the selection rule and the model


def visible(lo: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` bool from each row's first visible key (``t + 1``: none): ``lo <= s <= t``."""
    T = lo.shape[0]
    s = torch.arange(T, device=lo.device)
    return (s[None, :] >= lo[:, None]) & (s[None, :] <= s[:, None])


def rule_topk(scores: torch.Tensor, vis: torch.Tensor, topk: int) -> torch.Tensor:
    """The op's contract on given scores: the first topk visible keys of a stable descending
    sort (NaN first, ties to the smaller position), -inf ones dropped, ascending, then -1."""
    T = scores.shape[0]
    masked = scores.masked_fill(~vis, -INF)
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :topk]
    chosen = vis.gather(1, order) & ~torch.isneginf(masked.gather(1, order))
    key = torch.where(chosen, order, T).sort(dim=1).values
    out = torch.where(key == T, -1, key)
    if out.shape[1] < topk:
        out = torch.cat([out, out.new_full((T, topk - out.shape[1]), -1)], dim=1)
    return out.to(torch.int32)


def threshold_search(hist: torch.Tensor, need: int, tpq: int):
    """The kernel's threshold search for one row as its ``tpq`` threads run it: thread j sums
    bins ``[NBINS - (j+1)·BPT, NBINS - j·BPT)`` from a rotated start, adds the partial sums of
    the threads below it, and the one whose range holds the need-th key from the top walks its
    bins downwards.  Returns ``(bin, keys above it, keys in it)`` (None if no thread finds)."""
    bpt = itk.NBINS // tpq
    parts = []
    for j in range(tpq):
        hi_bin = itk.NBINS - (j + 1) * bpt
        parts.append(sum(int(hist[hi_bin + (r + j) % bpt]) for r in range(bpt)))
    found = None
    for j in range(tpq):
        above = sum(parts[:j])
        if above < need <= above + parts[j]:
            assert found is None, "two threads claim the threshold"
            run = above
            for r in range(bpt):
                b = itk.NBINS - 1 - j * bpt - r
                h = int(hist[b])
                if found is None and run + h >= need:
                    found = (b, run, h)
                run += h
    return found


def kernel_model(scores: torch.Tensor, lo: torch.Tensor, topk: int, columns_per_query: int = 64,
                 stats: dict | None = None) -> torch.Tensor:
    """The kernel's selection on the CPU, on given fp32 ``scores [T, T]`` (row t's score of key
    s) and first visible keys ``lo [T]``: the score keys, histogram passes over the digits of
    ``DIGITS`` for the rows still unsettled (a row is settled when it sees at most topk keys,
    when it needs all of its threshold bin, or after the last digit), then the writing pass
    (taken: above the prefix, or at it with a tie rank below ``need``; not the -inf key; slot =
    keys taken before it).  Rows are independent; ``stats`` gets the passes each CTA of
    ``COLUMNS // columns_per_query`` rows makes (1 + its rows' most histogram passes)."""
    T = scores.shape[0]
    vis = visible(lo)
    key = itk.score_keys(scores)
    n = vis.sum(1)
    need = torch.minimum(n, torch.tensor(topk))
    act = n > topk
    pfx = torch.zeros(T, dtype=torch.int64)
    msk = torch.zeros(T, dtype=torch.int64)
    hist_passes = torch.zeros(T, dtype=torch.int64)
    for p, (shift, bits) in enumerate(itk.DIGITS):
        if not act.any():
            break
        hist_passes += act.long()
        match = vis & act[:, None] & ((key & msk[:, None]) == pfx[:, None])
        digit = (key >> shift) & ((1 << bits) - 1)
        hist = torch.zeros(T, itk.NBINS, dtype=torch.int64).scatter_add_(1, digit, match.long())
        incl = hist.flip(1).cumsum(1).flip(1)  # keys in this bin or above
        excl = incl - hist
        holds = (excl < need[:, None]) & (need[:, None] <= incl)
        assert (holds[act].sum(1) == 1).all(), "an unsettled row without one threshold bin"
        b = holds.long().argmax(1)
        above = excl.gather(1, b[:, None])[:, 0]
        count = hist.gather(1, b[:, None])[:, 0]
        left = need - above
        pfx = torch.where(act, pfx | (b << shift), pfx)
        msk = torch.where(act, msk | (((1 << bits) - 1) << shift), msk)
        need = torch.where(act, left, need)
        act = act & (p < len(itk.DIGITS) - 1) & (count > left)
    assert not act.any()
    mk = key & msk[:, None]
    eq = vis & (mk == pfx[:, None])
    rank = eq.long().cumsum(1) - eq.long()
    take = (vis & (mk > pfx[:, None]) | eq & (rank < need[:, None])) & (key != itk.NEG_INF_KEY)
    slot = take.long().cumsum(1) - take.long()
    assert (take.sum(1) <= topk).all()
    out = torch.full((T, topk), -1, dtype=torch.int32)
    rows, cols = take.nonzero(as_tuple=True)
    out[rows, slot[rows, cols]] = cols.to(torch.int32)
    if stats is not None:
        bq = itk.COLUMNS // columns_per_query
        per_cta = torch.nn.functional.pad(hist_passes, (0, -T % bq)).view(-1, bq).amax(1) + 1
        stats["passes"] = per_cta
    return out


def starts_for(T: int, cu_seqlens) -> torch.Tensor:
    """The kernel's ``starts`` as the op computes them."""
    cu = torch.empty(0, dtype=torch.int64) if cu_seqlens is None else torch.tensor(cu_seqlens)
    return key_starts(cu, T, "cpu").clamp(0, T)


def cu_tensor(cu_seqlens, device="cpu"):
    if cu_seqlens is None:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.tensor(cu_seqlens, dtype=torch.int32, device=device)


def integer_inputs(T, H, D, dtype, *, seed=0, device="cpu"):
    """q_idx, k_idx in {-2..2} and w in {-1, -1/2, 1/2, 1, 2}: every index score is an exact
    fp32 number (|partial sums| < 2^24) in any summation order, and scores tie often."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (T, H, D), generator=gen).to(dtype)
    k = torch.randint(-2, 3, (T, D), generator=gen).to(dtype)
    w = torch.tensor([-1.0, -0.5, 0.5, 1.0, 2.0])[torch.randint(0, 5, (T, H), generator=gen)]
    return q.to(device), k.to(device), w.to(device)


def random_inputs(T, H, D, dtype, *, seed=0, device="cpu"):
    """DeepSeek-like: unit-normal q_idx, k_idx, w scaled by (H · D) ** -0.5."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k = torch.randn(T, D, generator=gen).to(dtype)
    w = torch.randn(T, H, generator=gen) * (H * D) ** -0.5
    return q.to(device), k.to(device), w.to(device)


def fp32_scores(q, k, w):
    """``[T, T]`` fp32 index scores of every pair (the reference's function, one block)."""
    return ref.index_scores(q.float(), k.float(), w.float())


# ---------------------------------------------------------------- no GPU: configs


def test_variants_are_distinct_and_valid():
    every = list(itk.variants())
    assert len({tlc.cache_key(FACTORY, c) for c in every}) == len(every)
    for c in every:
        itk._check_config(c["H"], c["D"], c["dtype"], 64, 256)
    assert DEEPSEEK in itk.DIMS and {(c["H"], c["D"]) for c in every} == set(itk.DIMS)


def test_shared_memory_keeps_a_margin():
    """About 162 KiB at DeepSeek dims (one CTA per SM); every built config stays clear of the
    sm_90 limit by the margin (TileLang lays the H 64 / D 128 kernel out in 166,144 B)."""
    for H, D in itk.DIMS:
        assert itk.smem_bytes(H, D) + itk._SMEM_MARGIN <= itk._SMEM_LIMIT
    assert 160_000 < itk.smem_bytes(*DEEPSEEK) < 170_000


@pytest.mark.parametrize("bad", [
    dict(dtype="float32"), dict(dtype="int32"), dict(H=16), dict(H=128), dict(H=48),
    dict(D=96), dict(D=32), dict(D=320), dict(block_N=128), dict(threads=128),
])
def test_bad_config_raises(bad):
    good = dict(H=64, D=128, dtype="bfloat16")
    with pytest.raises(ValueError):
        FACTORY(**(good | bad))


def test_config_for_names_a_variant_or_none():
    every = list(itk.variants())
    for (H, D), dtype in zip(itk.DIMS * 2, (BF16, BF16, FP16, FP16)):
        assert itk.config_for(H, D, dtype) in every
    for H, D, dtype in [(64, 128, torch.float32), (64, 128, torch.float64), (16, 128, BF16),
                        (64, 64, BF16), (2, 16, FP16)]:
        assert itk.config_for(H, D, dtype) is None


# ---------------------------------------------------------------- no GPU: the algorithm


def test_score_keys_follow_the_selection_order():
    """Keys ascend with the scores; -0.0 and +0.0 share one key; every NaN gets the largest
    key; -inf gets NEG_INF_KEY, below every other non-NaN score; denormals keep their order."""
    tiny = torch.finfo(torch.float32).tiny
    values = torch.tensor([-INF, -3e38, -1.5, -1.0, -tiny / 4, -0.0, 0.0, tiny / 4, tiny, 1e-30,
                           1.0, 1.5, 3e38, INF])
    keys = itk.score_keys(values)
    assert keys[0] == itk.NEG_INF_KEY
    assert keys[5] == keys[6] and (keys.diff()[:5] > 0).all() and (keys.diff()[6:] > 0).all()
    nans = torch.tensor([NAN, -NAN]).float()
    nans = torch.cat([nans, torch.tensor([0x7F800001, -1], dtype=torch.int32).view(torch.float32)])
    assert (itk.score_keys(nans) == 0xFFFFFFFF).all()
    assert int(keys.max()) < 0xFFFFFFFF and int(keys.min()) >= 0


def test_threshold_search_as_the_threads_run_it():
    """The kernel's search (rotated partial sums, prefix over threads, one walk) finds the bin
    holding the need-th key from the top, for both thread splits (64 and 32 threads a row)."""
    gen = torch.Generator().manual_seed(0)
    for tpq in (64, 32):
        for trial in range(30):
            hist = torch.zeros(itk.NBINS, dtype=torch.int64)
            if trial % 3 == 0:  # a few crowded bins, as the first digit sees
                hist[torch.randint(2000, 2100, (8,), generator=gen)] += torch.randint(
                    1, 900, (8,), generator=gen)
            elif trial % 3 == 1:  # everything in one bin (ties)
                hist[int(torch.randint(0, itk.NBINS, (1,), generator=gen))] = 5000
            else:  # spread, with the last digit's 256 bins only
                hist[:256] = torch.randint(0, 5, (256,), generator=gen)
            total = int(hist.sum())
            for need in sorted({1, 2, total // 3 + 1, total - 1, total} - {0}):
                b, above, count = threshold_search(hist, need, tpq)
                assert int(hist[b + 1:].sum()) == above < need <= above + count
                assert count == int(hist[b])


CASES = {  # name: (T, cu_seqlens, topk)
    "one sequence": (150, None, 40),
    "packed": (211, [0, 1, 70, 70, 150, 200], 33),  # a 1-token and an empty sequence, padding
    "topk 1": (97, [0, 50, 97], 1),
    "topk past T": (40, [0, 25, 40], 64),
    "short rows only": (90, [0, 30, 60, 90], 30),
    "T not a multiple of 8": (67, None, 20),
}
SCORE_KINDS = ("continuous", "few values", "special values", "all equal")


def scores_of(kind: str, T: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "continuous":
        return torch.randn(T, T, generator=gen) * 0.3
    if kind == "few values":  # ties everywhere, on both sides of every threshold
        return torch.randint(-3, 4, (T, T), generator=gen).float() * 0.25
    if kind == "all equal":  # the first topk visible keys of every row
        return torch.full((T, T), -0.0).masked_fill_(torch.rand(T, T, generator=gen) < 0.5, 0.0)
    values = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 1.0, -1.0, 1e-40, -1e-40, 2.0, 2.0])
    pick = torch.randint(0, len(values), (T, T), generator=gen)
    return torch.where(torch.rand(T, T, generator=gen) < 0.6, values[pick],
                       torch.randn(T, T, generator=gen))


@pytest.mark.parametrize("kind", SCORE_KINDS)
@pytest.mark.parametrize("case", CASES)
def test_model_equals_the_rule(case, kind):
    """On the same scores the kernel's selection is the op's rule bit for bit: ties to the
    smaller position, NaN above +inf, -0.0 == +0.0, -inf keys dropped, -1 after the count."""
    T, cu, topk = CASES[case]
    scores = scores_of(kind, T, seed=T + topk)
    lo = starts_for(T, cu)
    for columns in (64, 32):
        got = kernel_model(scores, lo, topk, columns)
        assert torch.equal(got, rule_topk(scores, visible(lo), topk)), (case, kind, columns)


def test_model_on_integer_inputs_equals_the_pytorch_kernel():
    """Integer inputs make every score exact, so the kernel's selection must equal the op's
    PyTorch kernel (blocked merges in fp32) exactly, ties included, at H_idx 64 / D_idx 128."""
    T, cu, topk = 300, [0, 1, 130, 131, 280], 64
    q, k, w = integer_inputs(T, *DEEPSEEK, BF16, seed=3)
    want = op.indexer_topk_reference(q, k, w, cu_tensor(cu), topk)
    got = kernel_model(fp32_scores(q, k, w), starts_for(T, cu), topk)
    assert torch.equal(got, want)
    assert (want[200:280] >= 0).all() and (want[280:] == -1).all()  # long rows, padding
    assert (want[1:130] == -1).any()  # short rows


def test_model_passes_at_deepseek_like_scores():
    """With continuous scores a row is nearly always settled after two digits: the CTAs of long
    rows average close to 3 passes over their keys, those of rows shorter than topk make 1."""
    T, topk = 1024, 256
    q, k, w = random_inputs(T, 16, 32, BF16, seed=1)
    stats = {}
    got = kernel_model(fp32_scores(q, k, w), starts_for(T, None), topk, stats=stats)
    assert torch.equal(got, rule_topk(fp32_scores(q, k, w), visible(starts_for(T, None)), topk))
    passes = stats["passes"].float()
    short = passes[: topk // 4]
    long = passes[topk // 4 + 1:]
    print(f"model passes per CTA, rows > topk: mean {long.mean():.2f}, max {int(long.max())}; "
          f"rows <= topk: {short.unique().tolist()}")
    assert (short == 1).all() and long.mean() <= 3.3 and long.max() <= 4


# ---------------------------------------------------------------- no GPU: the op's CUDA function


@pytest.fixture
def cuda_body(monkeypatch):
    """The op's CUDA function made runnable on any tensors, as on an sm_90 GPU: its kernel is a
    stand-in that checks the launch's arguments against the traced kernel and that q_idx,
    k_idx and w are 16-byte aligned, and launches nothing.  Yields the configs asked for."""
    asked = []

    def checking_kernel_for(family, config):
        assert family == FAMILY
        asked.append(config)
        check = launch_checker(FACTORY, config)

        def launch(q, k, w, starts, indices):
            assert all(x.data_ptr() % 16 == 0 for x in (q, k, w))
            check(q, k, w, starts, indices)
        return launch

    monkeypatch.setattr(op, "tilelang_usable", lambda device: True)
    monkeypatch.setattr(op, "kernel_for", checking_kernel_for)
    monkeypatch.delenv(op.TOPK_KERNEL_SWITCH, raising=False)  # on by default
    return asked


def meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("cu", [None, "int32", "int64"])
@pytest.mark.parametrize("dims", itk.DIMS, ids=lambda d: f"H{d[0]}-D{d[1]}")
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_cuda_body_launches_the_kernel_reading_no_value(cuda_body, dims, dtype, cu):
    """Meta tensors have no values: any host read of one (a sync on the GPU) would raise."""
    H, D = dims
    cu_seqlens = meta(0, dtype=torch.int64) if cu is None else meta(4, dtype=getattr(torch, cu))
    out = op.indexer_topk_cuda(meta(9, H, D, dtype=dtype), meta(9, D, dtype=dtype),
                               meta(9, H, dtype=torch.float64), cu_seqlens, 2048)
    assert out.shape == (9, 2048) and out.dtype == torch.int32
    assert cuda_body == [itk.config_for(H, D, dtype)]


def test_cuda_body_aligns_views_that_start_mid_row(cuda_body):
    q = torch.randn(3 * 64 * 128 + 1).to(BF16)[1:].view(3, 64, 128)  # 2 bytes into its storage
    k = torch.randn(3 * 128 + 3).to(BF16)[3:].view(3, 128)
    w = torch.randn(3 * 64 + 1)[1:].view(3, 64)  # fp32 already, 4 bytes in
    op.indexer_topk_cuda(q, k, w, cu_tensor([0, 3]), 5)
    assert len(cuda_body) == 1


FALLBACKS = {  # case: (q_idx, k_idx, topk)
    "fp32": ((5, 64, 128, torch.float32), torch.float32, 3),
    "fp64": ((5, 64, 128, torch.float64), torch.float64, 3),
    "k_idx dtype": ((5, 64, 128, BF16), FP16, 3),
    "dims not built": ((5, 16, 32, BF16), BF16, 3),
    "no token": ((0, 64, 128, BF16), BF16, 3),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_cuda_body_falls_back_to_the_pytorch_kernel(cuda_body, case):
    (T, H, D, dt), k_dt, topk = FALLBACKS[case]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=gen).to(dt)
    k = torch.randn(T, D, generator=gen).to(k_dt)
    w = torch.randn(T, H, generator=gen)
    cu = cu_tensor(None)
    got = op.indexer_topk_cuda(q, k, w, cu, topk)
    assert cuda_body == []
    assert torch.equal(got, op.indexer_topk_reference(q, k, w, cu, topk))


def test_cuda_body_obeys_the_disable_switch(monkeypatch):
    """``TORCH_DPLR_DISABLE_TILELANG=1`` keeps the PyTorch kernel."""
    def no_kernel(*args):
        raise AssertionError("a kernel was asked for")

    monkeypatch.setenv("TORCH_DPLR_DISABLE_TILELANG", "1")
    monkeypatch.setattr(op, "kernel_for", no_kernel)
    q, k, w = random_inputs(6, 64, 128, BF16)
    got = op.indexer_topk_cuda(q, k, w, cu_tensor(None), 4)
    assert torch.equal(got, op.indexer_topk_reference(q, k, w, cu_tensor(None), 4))


# ---------------------------------------------------------------- nvcc, no GPU


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found")
def test_every_variant_compiles(cold_cache):
    """Every variant compiled for sm_90a into an empty cache (prints each compile time): wgmma
    for the scores, cp.async key tiles, the warp collectives, no TMA descriptors, and every
    size but the dims symbolic (one build serves every T and topk)."""
    from tvm import tirx

    configs = list(itk.variants())
    lines = []
    tlc.build_all([(FACTORY, c) for c in configs], progress=lines.append, load=False)
    print("\n".join(lines))
    done = [line for line in lines if line.startswith("[")]
    assert len(done) == len(configs) and not any("FAILED" in line for line in done), lines
    for config in configs:
        kernel = tlc.build(FACTORY, **config)
        src = kernel.get_kernel_source()
        assert "__global__" in src and "cp_async" in src and "wgmma_ss" in src, config
        assert "__match_any_sync" in src and "__ballot_sync" in src, config
        assert "CUtensorMap" not in src, config
        names = {str(d) for p in kernel.params for d in p.shape if isinstance(d, tirx.Var)}
        for size in ("T", "K"):
            assert any(n == size or n.startswith(size + "_") for n in names), (config, names)


# ---------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def gpu_kernels():
    """Every variant, compiled up front (from TILELANG_CACHE_DIR when it was filled before)."""
    if torch.cuda.get_device_capability() != (9, 0):  # the kernels are built for sm_90a only
        pytest.skip("needs an sm_90 GPU (H100 / H200)")
    tlc.build_all([(FACTORY, c) for c in itk.variants()], progress=print, load=False)


gpu = pytest.mark.usefixtures("ieee_fp32_matmul", "gpu_kernels")


@pytest.fixture
def tilelang_only(monkeypatch):
    """Through the op, a fall back to the PyTorch kernel fails the test (the reference is then
    called as ``reference``)."""
    reference = op.indexer_topk_reference

    def forbidden(*args):
        raise AssertionError("dsa::indexer_topk fell back to its PyTorch kernel")

    monkeypatch.delenv("TORCH_DPLR_DISABLE_TILELANG", raising=False)
    monkeypatch.delenv(op.TOPK_KERNEL_SWITCH, raising=False)  # on by default
    monkeypatch.setattr(op, "indexer_topk_reference", forbidden)
    return reference


def run_prefilled(q, k, w, cu_seqlens, topk, fill=-7):
    """The compiled kernel called directly, its output pre-filled with ``fill``."""
    kernel = tlc.build(FACTORY, **itk.config_for(q.shape[1], q.shape[2], q.dtype))
    T = q.shape[0]
    out = torch.full((T, topk), fill, dtype=torch.int32, device=q.device)
    starts = key_starts(cu_seqlens, T, q.device).clamp(0, T).to(torch.int32)
    kernel(q.contiguous(), k.contiguous(), w.float().contiguous(), starts, out)
    torch.cuda.synchronize()
    return out


def assert_well_formed(indices, cu_seqlens, topk):
    """Every row: distinct visible keys ascending, then -1, as many as it can take."""
    T = indices.shape[0]
    lo = key_starts(cu_seqlens, T, indices.device)
    t = torch.arange(T, device=indices.device)
    count = (t - lo + 1).clamp(min=0, max=topk)
    valid = indices >= 0
    assert torch.equal(valid, torch.arange(topk, device=indices.device)[None] < count[:, None])
    idx = indices.long()
    assert ((idx >= lo[:, None]) & (idx <= t[:, None]) | ~valid).all(), "an invisible key"
    assert ((idx[:, 1:] > idx[:, :-1]) | ~valid[:, 1:]).all(), "not strictly ascending"


def dense_scores(q, k, w, block=256):
    """``[T, T]`` fp64 index scores, a block of queries at a time (the per-head products of
    all T queries would not fit)."""
    T = q.shape[0]
    out = torch.empty(T, T, dtype=torch.float64, device=q.device)
    kd = k.double()
    for t0 in range(0, T, block):
        per_head = torch.einsum("thd,sd->ths", q[t0:t0 + block].double(), kd).relu_()
        out[t0:t0 + block] = torch.einsum("ths,th->ts", per_head, w[t0:t0 + block].double())
    return out


def assert_rounding_level_agreement(got, want, scores, cu_seqlens, label):
    """The kernel's and the PyTorch kernel's selections differ only in keys whose exact score
    is within fp32 rounding (2e-5 of the row's largest |score|) of the row's k-th best."""
    T, topk = got.shape
    vis = visible(key_starts(cu_seqlens, T, got.device))
    masked = scores.masked_fill(~vis, -INF)
    kth = masked.topk(min(topk, T), dim=1).values[:, -1:]
    tol = 2e-5 * masked.masked_fill(~vis, 0).abs().amax(1, keepdim=True)
    sel_got = torch.zeros(T, T + 1, dtype=torch.bool, device=got.device)
    sel_want = torch.zeros_like(sel_got)
    sel_got.scatter_(1, torch.where(got >= 0, got, T).long(), True)
    sel_want.scatter_(1, torch.where(want >= 0, want, T).long(), True)
    diff = (sel_got ^ sel_want)[:, :T]
    rows, cols = diff.nonzero(as_tuple=True)
    near = (scores[rows, cols] - kth[rows, 0]).abs() <= tol[rows, 0]
    same = (~diff.any(1)).float().mean().item()
    print(f"{label}: {same:.4%} of rows select the same keys, {rows.numel()} keys differ, all "
          f"within fp32 rounding of the k-th score: {bool(near.all())}")
    assert near.all(), "a key far from its row's threshold is selected differently"
    assert same > 0.95


# T 8192 as a 1-token, a 3071-token, an empty, a 4000-token and a 1000-token sequence, then a
# 120-token padding tail (rows with no key)
DEEPSEEK_CU = [0, 1, 3072, 3072, 7072, 8072]
DEEPSEEK_T, DEEPSEEK_K = 8192, 2048


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_op_exact_on_integer_inputs_at_deepseek_sizes(tilelang_only, dtype):
    """Exact scores (integer inputs) at T 8192 packed, H_idx 64, D_idx 128, topk 2048: the op's
    CUDA kernel equals its PyTorch kernel bit for bit, ties (many) included."""
    q, k, w = integer_inputs(DEEPSEEK_T, *DEEPSEEK, dtype, device="cuda")
    cu = cu_tensor(DEEPSEEK_CU, "cuda")
    got = torch.ops.dsa.indexer_topk(q, k, w, cu, DEEPSEEK_K)
    want = tilelang_only(q, k, w, cu, DEEPSEEK_K)
    assert_well_formed(got, cu, DEEPSEEK_K)
    assert torch.equal(got, want)


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=dtype_id)
def test_op_at_deepseek_sizes(tilelang_only, dtype):
    """Random DeepSeek-like inputs, T 8192 packed: the selection equals the PyTorch kernel's
    but for keys within fp32 rounding of their row's k-th score."""
    q, k, w = random_inputs(DEEPSEEK_T, *DEEPSEEK, dtype, device="cuda")
    cu = cu_tensor(DEEPSEEK_CU, "cuda")
    got = torch.ops.dsa.indexer_topk(q, k, w, cu, DEEPSEEK_K)
    want = tilelang_only(q, k, w, cu, DEEPSEEK_K)
    assert_well_formed(got, cu, DEEPSEEK_K)
    assert_rounding_level_agreement(got, want, dense_scores(q, k, w), cu,
                                    f"T{DEEPSEEK_T} {dtype_id(dtype)}")


def time_ms(fn, reps=10):
    from benchmarks.timing import Timer

    return Timer("cuda", reps=reps, cap_s=10.0).measure(fn).ms


@pytest.mark.cuda
@gpu
def test_speedup_over_the_pytorch_kernel(tilelang_only):
    """The issue's target: at T 8192 (one sequence), H_idx 64, D_idx 128, topk 2048, bf16, the
    fused kernel is at least 5x the PyTorch kernel; prints both times."""
    q, k, w = random_inputs(DEEPSEEK_T, *DEEPSEEK, BF16, device="cuda")
    cu = cu_tensor(None, "cuda")
    fused = time_ms(lambda: torch.ops.dsa.indexer_topk(q, k, w, cu, DEEPSEEK_K))
    pytorch = time_ms(lambda: tilelang_only(q, k, w, cu, DEEPSEEK_K), reps=3)
    macs = DEEPSEEK_T * (DEEPSEEK_T + 1) / 2 * DEEPSEEK[0] * DEEPSEEK[1]
    print(f"\nindexer top-k T{DEEPSEEK_T} H{DEEPSEEK[0]} D{DEEPSEEK[1]} k{DEEPSEEK_K}: fused "
          f"{fused:.3f} ms ({2 * macs / fused / 1e9:.0f} TFLOP/s per scoring pass), PyTorch "
          f"{pytorch:.3f} ms, {pytorch / fused:.1f}x")
    assert pytorch / fused >= 5.0


VARIANT_CU = [0, 1, 130, 131, 280]  # a 1-token, a 129-, an empty... and a 20-token padding tail


def variant_id(config):
    return f"H{config['H']}-D{config['D']}-{config['dtype']}"


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("topk", [1, 7, 64, 100, 149, 400])
@pytest.mark.parametrize("config", list(itk.variants()), ids=variant_id)
def test_every_variant(config, topk):
    """Every variant at small sizes (the compute-sanitizer target), direct calls with the output
    pre-filled: integer inputs equal the PyTorch kernel exactly; random ones agree to rounding.
    T 300 is not a multiple of the query block; topk from 1 past the longest sequence."""
    T, H, D = 300, config["H"], config["D"]
    dtype = getattr(torch, config["dtype"])
    cu = cu_tensor(VARIANT_CU, "cuda")
    for make, exact in ((integer_inputs, True), (random_inputs, False)):
        q, k, w = make(T, H, D, dtype, seed=topk, device="cuda")
        got = run_prefilled(q, k, w, cu, topk)
        want = op.indexer_topk_reference(q, k, w, cu, topk)
        assert_well_formed(got, cu, topk)
        if exact:
            assert torch.equal(got, want)
        else:
            assert_rounding_level_agreement(got, want, dense_scores(q, k, w), cu,
                                            f"{variant_id(config)} k{topk}")


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("config", list(itk.variants()), ids=variant_id)
def test_equal_and_non_finite_scores(config):
    """All-equal scores (q_idx = 0: every score +-0, the first topk visible keys win), and
    non-finite ones (inf entries in q_idx and k_idx: +-inf and NaN scores; NaN ranks first,
    -inf keys are never taken) equal the PyTorch kernel exactly."""
    T, H, D, topk = 260, config["H"], config["D"], 50
    dtype = getattr(torch, config["dtype"])
    cu = cu_tensor([0, 100, 250], "cuda")
    q, k, w = integer_inputs(T, H, D, dtype, seed=5, device="cuda")
    zero_q = torch.zeros_like(q)
    assert torch.equal(run_prefilled(zero_q, k, w, cu, topk),
                       op.indexer_topk_reference(zero_q, k, w, cu, topk))
    q[::7, :, 3] = INF
    q[1::11, 0, :] = -INF
    k[::13, 5] = INF
    k[2::17, :] = 0
    got = run_prefilled(q, k, w, cu, topk)
    want = op.indexer_topk_reference(q, k, w, cu, topk)
    assert torch.equal(got, want)


@pytest.mark.cuda
@gpu
def test_op_replays_in_a_cuda_graph(tilelang_only):
    """The op's CUDA path syncs nothing: it captures into a CUDA graph (once its kernel is
    loaded) and the replay is right."""
    T, topk = 700, 96
    q, k, w = integer_inputs(T, *DEEPSEEK, BF16, device="cuda")
    cu = cu_tensor([0, 300, 650], "cuda")
    torch.ops.dsa.indexer_topk(q, k, w, cu, topk)  # loads the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = torch.ops.dsa.indexer_topk(q, k, w, cu, topk)
    got.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, tilelang_only(q, k, w, cu, topk))


def test_cuda_body_keeps_the_pytorch_kernel_when_switched_off(cuda_body, monkeypatch):
    monkeypatch.setenv(op.TOPK_KERNEL_SWITCH, "0")
    q, k, w = random_inputs(50, 64, 128, BF16)
    cu = cu_tensor([0, 20, 50], "cpu")
    assert torch.equal(op.indexer_topk_cuda(q, k, w, cu, 9),
                       op.indexer_topk_reference(q, k, w, cu, 9))
    assert cuda_body == []


@pytest.mark.cuda
def test_op_keeps_the_pytorch_kernel_elsewhere():
    """fp32 inputs and dims without a variant run the PyTorch kernel on the GPU too."""
    for H, D, dtype in [(64, 128, torch.float32), (8, 16, BF16)]:
        q, k, w = random_inputs(50, H, D, dtype, device="cuda")
        cu = cu_tensor([0, 20, 50], "cuda")
        assert torch.equal(torch.ops.dsa.indexer_topk(q, k, w, cu, 9),
                           op.indexer_topk_reference(q, k, w, cu, 9))


def test_module_is_importable_as_a_family():
    """The family's conventions (``csrc_tl.<name>`` with ``<name>_kernel`` and ``variants()``),
    so ``csrc_tl.DSA_KERNEL_MODULES`` can list it."""
    module = importlib.import_module(f"csrc_tl.{FAMILY}")
    assert getattr(module, f"{FAMILY}_kernel") is FACTORY and list(module.variants())
