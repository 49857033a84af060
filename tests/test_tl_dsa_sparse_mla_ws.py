"""The warp-specialized sparse MLA forward (csrc_tl/dsa_sparse_mla_fwd_ws.py), against the
op's PyTorch kernel and the two-warpgroup kernel.

* No GPU: which calls take it (64 heads per CTA, dims it builds, not switched off), the launch's
  arguments checked against the traced kernel on meta tensors (no value read); its variants
  and shared memory.  Its sm_90a compile runs with the other sparse MLA families
  (tests/test_tl_dsa_sparse_mla.py::test_every_variant_compiles).
* GPU (marker ``cuda``): DeepSeek-V3.2 sizes through the op, the fallback forbidden (prints
  its time against the two-warpgroup kernel's); direct calls with outputs pre-filled
  with NaN at small sizes: padded head blocks, odd and even slot-block counts, k not a multiple
  of the block, -1 and out-of-range slots, rows without a valid slot, T_kv != T.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("tilelang")

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import dsa_sparse_mla_fwd as smla  # noqa: E402
from csrc_tl import dsa_sparse_mla_fwd_ws as ws  # noqa: E402
from csrc_tl.launch_check import launch_checker  # noqa: E402
from test_tl_dsa_sparse_mla import (  # noqa: E402
    BF16, DEEPSEEK, FP16, causal_indices, deepseek_case, dtype_id, meta, parity, random_inputs,
    reference, time_ms)
from torch_dplr.dsa.ops import sparse_mla as op  # noqa: E402

FACTORY = ws.dsa_sparse_mla_fwd_ws_kernel


def test_variants_are_the_dims_it_supports():
    configs = list(ws.variants())
    assert configs and len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    assert {(c["D_qk"], c["d_v"]) for c in configs} == {d for d in smla.DIMS
                                                        if ws.supports(*d)}
    assert ws.supports(*DEEPSEEK)
    assert ws.smem_bytes(*DEEPSEEK) == 229_888  # q, 2 x 64 kv rows, P, alpha, l
    assert not ws.supports(544, 512)  # a 32-column rope tail: not whole 64-column groups
    with pytest.raises(ValueError, match="not built"):
        FACTORY(D_qk=544, d_v=512, dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        FACTORY(D_qk=576, d_v=512, dtype="float32")


@pytest.fixture
def asked(monkeypatch):
    """The op's CUDA function on meta tensors as on an sm_90 GPU; every kernel it asks for is a
    check of the launch against that family's traced kernel.  Yields (family, config) asked."""
    families = {"dsa_sparse_mla_fwd": smla.dsa_sparse_mla_fwd_kernel,
                "dsa_sparse_mla_fwd_ws": FACTORY}
    seen = []

    def checking_kernel_for(family, config):
        seen.append((family, config))
        return launch_checker(families[family], config)

    monkeypatch.setattr(op, "tilelang_usable", lambda device: True)
    monkeypatch.setattr(op, "kernel_for", checking_kernel_for)
    return seen


@pytest.mark.parametrize("switched_off", [False, True])
@pytest.mark.parametrize("H", [16, 32, 33, 64, 128])
@pytest.mark.parametrize("dims", smla.DIMS, ids=lambda d: f"{d[0]}-{d[1]}")
def test_calls_at_64_heads_per_cta_take_it(asked, monkeypatch, switched_off, H, dims):
    D_qk, d_v = dims
    if switched_off:
        monkeypatch.setenv(op.FWD_WS_SWITCH, "0")
    else:
        monkeypatch.delenv(op.FWD_WS_SWITCH, raising=False)
    o, lse = op.sparse_mla_fwd_cuda(meta(7, H, D_qk, dtype=FP16), meta(11, D_qk, dtype=FP16),
                                    meta(7, 300, dtype=torch.int32), 0.1, d_v)
    assert o.shape == (7, H, d_v) and lse.shape == (7, H)
    config = smla.config_for(D_qk, d_v, H, FP16)
    takes_it = not switched_off and config["block_H"] == 64 and ws.supports(D_qk, d_v)
    want = (("dsa_sparse_mla_fwd_ws", dict(D_qk=D_qk, d_v=d_v, dtype="float16")) if takes_it
            else ("dsa_sparse_mla_fwd", config))
    assert asked == [want]


# ---------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def ws_kernels():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU (H100 / H200)")
    configs = [(FACTORY, c) for c in ws.variants()]
    configs += [(smla.dsa_sparse_mla_fwd_kernel, smla.config_for(*DEEPSEEK, 128, BF16))]
    tlc.build_all(configs, progress=print, load=False)


gpu = pytest.mark.usefixtures("ieee_fp32_matmul", "ws_kernels")


def run_ws(q, kv, indices, scale, d_v):
    kernel = tlc.build(FACTORY, D_qk=q.shape[2], d_v=d_v, dtype=dtype_id(q.dtype))
    o = torch.full((q.shape[0], q.shape[1], d_v), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    kernel(q, kv, indices, float(scale), o, lse)
    torch.cuda.synchronize()
    return o, lse


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("H,dtype", [(64, BF16), (128, BF16), (128, FP16)],
                         ids=lambda x: dtype_id(x) if isinstance(x, torch.dtype) else f"H{x}")
def test_op_at_deepseek_sizes(monkeypatch, H, dtype):
    """T 4096 packed with a padding tail, k 2048, D 576 / 512, through the op with the PyTorch
    kernel forbidden; prints its time and the two-warpgroup kernel's (switched to)."""
    def forbidden(*args):
        raise AssertionError("dsa::sparse_mla_fwd fell back to its PyTorch kernel")

    monkeypatch.delenv("TORCH_DPLR_DISABLE_TILELANG", raising=False)
    monkeypatch.setattr(op, "sparse_mla_fwd_reference", forbidden)
    q, kv, idx, scale = deepseek_case(H, dtype)
    d_v = DEEPSEEK[1]
    call = lambda: torch.ops.dsa.sparse_mla_fwd(q, kv, idx, scale, d_v)  # noqa: E731
    monkeypatch.delenv(op.FWD_WS_SWITCH, raising=False)
    o, lse = call()
    parity(o, lse, *reference(q, kv, idx, scale, d_v), dtype, f"warp-specialized H{H}")
    ms = time_ms(call)
    monkeypatch.setenv(op.FWD_WS_SWITCH, "0")
    base = time_ms(call)
    flops = 2 * q.shape[0] * H * idx.shape[1] * sum(DEEPSEEK)
    print(f"  warp-specialized {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), two-warpgroup "
          f"{base:.3f} ms ({flops / base / 1e9:.0f} TFLOP/s): {base / ms:.2f}x")


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("config", list(ws.variants()),
                         ids=lambda c: f"{c['D_qk']}-{c['d_v']}-{c['dtype']}")
@pytest.mark.parametrize("k", [1, 64, 65, 100, 129, 300])
def test_every_variant_at_small_sizes(config, k):
    """96 heads (a full and a padded block), a 1-token sequence, a padding tail, one, two, three
    and five slot blocks (an odd count runs one block past k), -1 tails and holes, a row of -1,
    out-of-range values among the slots, kv longer than q."""
    T, T_kv, H = 300, 340, 96
    D_qk, d_v, dtype = config["D_qk"], config["d_v"], getattr(torch, config["dtype"])
    q, kv = random_inputs(T, H, D_qk, dtype, T_kv=T_kv, seed=k, device="cuda")
    idx = causal_indices(T, k, [0, 1, 130, 280], seed=k, device="cuda")
    idx[200] = -1
    wild = idx.clone()
    wild[7::11, ::3] = T_kv + 5
    wild[3::13, 1::4] = -9
    clean = torch.where((wild >= 0) & (wild < T_kv), wild, -1)
    scale = 0.7 * D_qk ** -0.5
    o, lse = run_ws(q, kv, wild, scale, d_v)
    parity(o, lse, *reference(q, kv, clean, scale, d_v), dtype, f"{config} k{k}")
