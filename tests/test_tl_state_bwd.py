"""GPU parity of the TileLang state-pass backward with its PyTorch stage, both implementations:
``single`` (csrc_tl/state_bwd.py, one kernel) and ``split`` (csrc_tl/state_bwd_split.py, the
small-grid path: a reverse dh scan, then the per-chunk gradients from h and dh).

The kernels are called directly, in order, as the op does (no torch dispatch): inputs are
RWKV-7-shaped tensors pushed through the reference intra / WY / state forward stages on the
GPU, outputs are compared with ``chunk_state_bwd_reference`` by RMS(err)/RMS(ref) per output,
and must be finite everywhere (outputs and the split's dh workspace are pre-filled with NaN,
so a row or chunk a kernel forgets to write fails too).
"""

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import state_bwd, state_bwd_split  # noqa: E402
from torch_dplr.ops.intra import chunk_intra_fwd_reference  # noqa: E402
from torch_dplr.ops.shapes import state_bwd_shapes  # noqa: E402
from torch_dplr.ops.state import chunk_state_bwd_reference, chunk_state_fwd_reference  # noqa: E402
from torch_dplr.ops.varlen import as_one_sequence_list as flat  # noqa: E402
from torch_dplr.ops.varlen import kernel_tables  # noqa: E402
from torch_dplr.ops.wy import chunk_wy_fwd_reference  # noqa: E402
from torch_dplr.testing import RWKV7_BOUND, make_inputs, rms_ratio  # noqa: E402

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
NAMES = ("dqg", "dkg", "dbg", "dw", "du", "dv", "dA_qk", "dA_qb", "dgl", "dh0")
IMPLS = ("single", "split")


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param

# RMS(err)/RMS(ref) bars. The kernel rounds its fp32 GEMM operands h, dh and dvn to the input
# dtype once (emulated on the CPU: ~2.6e-3 bf16 / ~4e-4 fp16 on dqg/dkg/dbg/dw, ~1.5e-3 on
# du/dv); dA_* see no rounded fp32 operand (only accumulation order differs), dgl and dh0 are
# fp32 and only see dh's accumulated rounding.
TOLERANCES = {
    torch.bfloat16: dict(default=6e-3, dA_qk=2e-3, dA_qb=2e-3, dgl=2e-3, dh0=2e-3),
    torch.float16: dict(default=1e-3, dA_qk=5e-4, dA_qb=5e-4, dgl=5e-4, dh0=5e-4),
}


def _bound(gates):
    return RWKV7_BOUND if gates in ("rwkv7", "saturated") else float("-inf")


def _stage_inputs(B, T, H, K, C, dtype, gates, cu=None, seed=0):
    """Forward stage outputs the backward reads, made by the reference stages on the GPU."""
    dev = DEVICE
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(B, T, H, K, dtype=dtype, gates=gates, seed=seed, device=dev, num_states=N)
    cu_t = (torch.tensor(cu, dtype=torch.int64, device=dev) if cu is not None
            else torch.empty(0, dtype=torch.int64, device=dev))
    gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = chunk_intra_fwd_reference(
        inp["q"], inp["k"], inp["a"], inp["b"], inp["gk"], cu_t, K ** -0.5, C, _bound(gates))
    _, w, u = chunk_wy_fwd_reference(A_ab, A_ak, ag, inp["v"], cu_t, C)
    _, ht, h, v_new = chunk_state_fwd_reference(qg, kg, bg, w, u, inp["v"], A_qk, A_qb, gl,
                                                inp["initial_state"], cu_t, C, True, True)
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    do = torch.randn(inp["v"].shape, generator=g, device=dev).to(dtype)
    dht = torch.randn(ht.shape, generator=g, device=dev)
    return dict(qg=qg, kg=kg, bg=bg, w=w, v=inp["v"], A_qk=A_qk, A_qb=A_qb, gl=gl, h=h,
                v_new=v_new, do=do, dht=dht, h0=inp["initial_state"], cu=cu_t)


def _run_kernel(x, C, use_dht, use_initial_state, impl):
    """Allocate the op's outputs (NaN-filled), launch ``impl``'s kernels on the flattened
    one-sequence-list form (a rect batch as cu_seqlens [0, T, 2T, ...]), return the outputs."""
    qg, v, gl, cu = x["qg"], x["v"], x["gl"], x["cu"]
    B, T, H, K = qg.shape
    V = v.shape[-1]
    outs = [torch.full(shape, float("nan"), dtype=dt, device=qg.device) for shape, dt in
            state_bwd_shapes(qg, x["kg"], x["bg"], x["w"], v, x["A_qk"], x["A_qb"], gl, x["h0"],
                             use_initial_state)]
    dqg, dkg, dbg, dw, du, dv, dA_qk, dA_qb, dgl, dh0 = outs
    tables = kernel_tables(cu, B, T, C, qg.device)
    dht = x["dht"] if use_dht else gl.new_empty(0, H, K, V)
    dh0 = dh0.view(-1, H, K, V)  # (0, H, K, V) when absent
    if impl == "single":
        kernel = tlc.build(state_bwd.state_bwd_kernel, C=C, K=K, V=V, dtype=qg.dtype)
        inputs = (qg, x["kg"], x["bg"], x["w"], v, x["A_qk"], x["A_qb"], gl, x["h"], x["v_new"],
                  x["do"])
        kernel(*map(flat, inputs), dht, tables.cu_seqlens, tables.chunk_offsets,
               *map(flat, outs[:9]), dh0)
        return outs
    dh_scan, chunk_grads = (tlc.build(state_bwd_split.state_bwd_split_kernel, C=C, K=K, V=V,
                                      dtype=qg.dtype, stage=stage)
                            for stage in state_bwd_split.STAGES)
    dh = torch.full(x["h"].shape, float("nan"), device=qg.device)
    dh_scan(*map(flat, (qg, x["bg"], x["w"], x["A_qb"], gl, x["do"])), dht, tables.cu_seqlens,
            tables.chunk_offsets, flat(du), flat(dh), dh0)
    chunk_grads(*map(flat, (x["kg"], v, x["A_qk"], gl, x["h"], x["v_new"], x["do"], du, dh)),
                tables.chunk_start, tables.chunk_len,
                *map(flat, (dqg, dkg, dbg, dw, dv, dA_qk, dA_qb, dgl)))
    return outs


def _check(B, T, H, K, C, dtype, gates, impl, cu=None, use_dht=True, use_initial_state=True,
           seed=0):
    x = _stage_inputs(B, T, H, K, C, dtype, gates, cu, seed)
    dht_arg = x["dht"] if use_dht else x["gl"].new_zeros(0)
    ref = chunk_state_bwd_reference(x["qg"], x["kg"], x["bg"], x["w"], x["v"], x["A_qk"], x["A_qb"],
                                    x["gl"], x["h"], x["v_new"], x["do"], dht_arg, x["h0"], x["cu"],
                                    C, use_initial_state, use_dht)
    out = _run_kernel(x, C, use_dht, use_initial_state, impl)
    if out[0].is_cuda:
        torch.cuda.synchronize()
    tol = TOLERANCES[dtype]
    errors, bad = {}, []
    for name, o, r in zip(NAMES, out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype, name
        if name == "dh0" and not use_initial_state:
            continue
        if not torch.isfinite(o).all():
            bad.append(f"{name}: {int((~torch.isfinite(o)).sum())} non-finite")
            continue
        errors[name] = rms_ratio(o, r)
        if errors[name] > tol.get(name, tol["default"]):
            bad.append(f"{name}: {errors[name]:.2e} > {tol.get(name, tol['default']):.0e}")
    # above the diagonal (column > the row's position in its chunk) dA_* are exact zeros
    pos = _chunk_pos(x["qg"].shape[1], C, x["cu"])
    upper = torch.arange(C, device=pos.device)[None, :] > pos[:, None]  # [T, C]
    for name in ("dA_qk", "dA_qb"):
        o = out[NAMES.index(name)]
        assert (o.masked_select(upper[None, :, None, :].expand_as(o)) == 0).all(), name
    assert not bad, f"{dict((k, f'{v:.1e}') for k, v in errors.items())}; failures: {bad}"
    return errors


def _chunk_pos(T, C, cu):
    """Position of each token inside its chunk (chunks restart at every sequence start)."""
    t = torch.arange(T, device=cu.device)
    if cu.numel() == 0:
        return t % C
    seq = torch.searchsorted(cu[1:], t, right=True)
    return (t - cu[seq]) % C


# ---- real sizes -------------------------------------------------------------------------

@pytest.mark.parametrize("gates", ["rwkv7", "unbounded"])
def test_real_size_b1(gates, impl):
    _check(1, 2048, 16, 128, 64, torch.bfloat16, gates, impl)


def test_real_size_b2(impl):
    _check(2, 4096, 32, 128, 64, torch.bfloat16, "rwkv7", impl, seed=1)


def test_real_size_varlen(impl):
    # a 1-token sequence, an empty one, a long one, and a ragged tail
    _check(1, 4096, 16, 128, 64, torch.bfloat16, "saturated", impl, cu=[0, 1, 1, 3000, 4096])


# ---- every config at small odd sizes ----------------------------------------------------

_SMALL = [(C, K, dt) for C in state_bwd.CHUNK_SIZES for K in state_bwd.HEAD_DIMS
          for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("C,K,dtype", _SMALL, ids=lambda p: str(p).replace("torch.", ""))
def test_small_rect(C, K, dtype, impl):
    gates = ("rwkv7", "saturated", "unbounded")[(C // 16 + K // 64) % 3]
    _check(2, 300, 3, K, C, dtype, gates, impl, use_dht=True, use_initial_state=True, seed=C + K)


@pytest.mark.parametrize("C,K,dtype", _SMALL, ids=lambda p: str(p).replace("torch.", ""))
def test_small_varlen(C, K, dtype, impl):
    gates = ("unbounded", "rwkv7", "saturated")[(C // 16 + K // 64) % 3]
    _check(1, 301, 3, K, C, dtype, gates, impl, cu=[0, 1, 1, C + 1, 2 * C, 301], use_dht=True,
           use_initial_state=True, seed=C + K + 1)


@pytest.mark.parametrize("use_dht,use_initial_state", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("varlen", [False, True])
def test_flags(use_dht, use_initial_state, varlen, impl):
    cu = [0, 77, 77, 200] if varlen else None
    _check(1, 200, 4, 64, 32, torch.bfloat16, "rwkv7", impl, cu=cu, use_dht=use_dht,
           use_initial_state=use_initial_state)


def test_single_short_sequence(impl):
    # T < C: one partial chunk per sequence, nothing prefetched
    _check(2, 5, 2, 128, 64, torch.bfloat16, "unbounded", impl)


def test_configs_are_variants():
    # every config this file builds is one the CI compile test builds
    built = [dict(C=C, K=K, V=K, dtype=str(dt).replace("torch.", "")) for C, K, dt in _SMALL]
    assert all(cfg in list(state_bwd.variants()) for cfg in built)
    split = [dict(cfg, stage=stage) for cfg in built for stage in state_bwd_split.STAGES]
    assert all(cfg in list(state_bwd_split.variants()) for cfg in split)


def test_deterministic(impl):
    # no atomics: two launches give bitwise-equal outputs (opcheck's aot test relies on it)
    x = _stage_inputs(1, 1000, 8, 128, 64, torch.bfloat16, "rwkv7", cu=[0, 10, 1000])
    a = _run_kernel(x, 64, True, True, impl)
    b = _run_kernel(x, 64, True, True, impl)
    for name, p, q in zip(NAMES, a, b):
        assert torch.equal(p, q), name
