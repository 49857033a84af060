"""The CUDA op bodies' launches, checked on the CPU against the kernels' traced signatures.

Each op's CUDA function runs here as its CPU kernel, with every TileLang kernel replaced by a
stand-in that checks its arguments as the real launch would bind them
(:func:`csrc_tl.launch_check.launch_checker`: argument count, dtypes, ranks, fixed and shared
symbolic sizes, contiguity) and launches nothing.  A forward+backward and a no-grad call of
the public function then exercise every launch a GPU call makes, in every kernel configuration
(chunk size, head dim, dtypes, gate style, rect with state and varlen without), with few and
with many SMs (the small-grid state backward and the fused no-grad forward on or off).  No GPU,
no nvcc: the kernels are only traced.  What the kernels compute is the GPU tests' business.
"""
import pytest
import torch

pytest.importorskip("tilelang")

import torch_dplr  # noqa: E402
from csrc_tl.launch_check import check_launch, launch_checker  # noqa: E402
from torch_dplr.ops import kernels  # noqa: E402
from torch_dplr.testing import RWKV7_BOUND, cuda_op_bodies_on_cpu, make_inputs  # noqa: E402

_checkers: dict = {}  # traced once per kernel configuration for the whole module


def _checking_kernel_for(launched: list):
    def kernel_for(op, chunk_size, K, V, dtype, gate_dtype=torch.float32,
                   lower_bound=float("-inf")):
        key = (op, chunk_size, K, V, dtype, gate_dtype, lower_bound)
        if key not in _checkers:
            factory, config = kernels.pipeline(chunk_size, K, V, dtype, gate_dtype, lower_bound)[op]
            _checkers[key] = launch_checker(factory, config, op)
        check = _checkers[key]

        def launch(*args):
            check(*args)
            launched.append(op)
        return launch
    return kernel_for


@pytest.fixture
def launches():
    """The CUDA bodies as CPU kernels with checking stand-ins for the kernels; yields the list
    of launched kernel names and a setter for the SM count the bodies see."""
    launched: list = []
    sms = {"count": 132}
    with cuda_op_bodies_on_cpu(_checking_kernel_for(launched), lambda: sms["count"]):
        yield launched, lambda count: sms.update(count=count)


CONFIGS = [(C, K, dtype, gate_dtype)
           for C in (16, 32, 64) for K in (64, 128)
           for dtype, gate_dtype in ((torch.bfloat16, torch.float32), (torch.float16, torch.float16))]


@pytest.mark.parametrize("C,K,dtype,gate_dtype", CONFIGS, ids=lambda p: str(p).replace("torch.", ""))
@pytest.mark.parametrize("gates", ["rwkv7", "unbounded"])
@pytest.mark.parametrize("layout", ["rect_state", "varlen_no_state"])
@pytest.mark.parametrize("sm_count", [132, 1], ids=["many_sms", "one_sm"])
def test_every_launch_binds_to_its_kernel(launches, C, K, dtype, gate_dtype, gates, layout,
                                          sm_count):
    launched, set_sm_count = launches
    set_sm_count(sm_count)
    varlen = layout == "varlen_no_state"
    inp = make_inputs(1 if varlen else 2, 100, 2, K, dtype=dtype, gates=gates,
                      num_states=3 if varlen else None)
    cu = torch.tensor([0, 1, C + 3, 100]) if varlen else None
    bound = RWKV7_BOUND if gates == "rwkv7" else None
    names = ("q", "k", "v", "a", "b")
    leaves = {n: inp[n].requires_grad_() for n in names}
    gk = inp["gk"].to(gate_dtype).requires_grad_()
    h0 = None if varlen else inp["initial_state"].requires_grad_()
    kw = dict(initial_state=h0, output_final_state=not varlen, cu_seqlens=cu, chunk_size=C,
              lower_bound=bound)

    o, ht = torch_dplr.chunk_dplr_delta_rule(*leaves.values(), gk, **kw)
    (o.float().sum() + (ht.sum() if ht is not None else 0)).backward()
    with torch.no_grad():
        torch_dplr.chunk_dplr_delta_rule(*leaves.values(), gk, **kw)

    # every stage ran its kernel (none fell back to the PyTorch stages)
    pairs = (3 if varlen else 2) * 2
    split = 4 * pairs <= sm_count  # ops.state.few_pairs
    fused_applies = (sm_count <= pairs and "fused_fwd" in kernels.pipeline(
        C, K, K, dtype, gate_dtype, float("-inf") if bound is None else bound))
    want = {"intra_fwd", "wy_fwd", "state_fwd", "intra_bwd", "wy_bwd",
            *(("state_bwd_dh", "state_bwd_grads") if split else ("state_bwd",)),
            *(("fused_fwd",) if fused_applies else ()),
            *(op for op in ("intra_fwd_exact", "intra_bwd_exact")
              if op in kernels.pipeline(C, K, K, dtype, gate_dtype,
                                        float("-inf") if bound is None else bound))}
    assert set(launched) == want


@pytest.mark.parametrize("C", [16, 64])
def test_two_op_pass_launches_the_stage_kernels(launches, C, monkeypatch):
    """``TORCH_DPLR_TRAINING_PASS=split``: the two ops' bodies launch the stage pass's kernels,
    plus the forward's once more (the backward recomputes it), every launch bound as on the
    GPU."""
    from torch_dplr.ops import dataflow
    launched, _ = launches
    inp = make_inputs(2, 100, 2, 64, dtype=torch.bfloat16)
    leaves = [inp[n].requires_grad_() for n in ("q", "k", "v", "a", "b", "gk", "initial_state")]

    def step(training_pass):
        monkeypatch.setenv(dataflow.TRAINING_PASS_VAR, training_pass)
        launched.clear()
        o, ht = torch_dplr.chunk_dplr_delta_rule(*leaves[:6], initial_state=leaves[6],
                                                 output_final_state=True, chunk_size=C,
                                                 lower_bound=RWKV7_BOUND)
        (o.float().sum() + ht.sum()).backward()
        return sorted(launched)

    stages = step("stages")
    with torch.no_grad():
        launched.clear()
        torch_dplr.chunk_dplr_delta_rule(*leaves[:6], initial_state=leaves[6], chunk_size=C,
                                         lower_bound=RWKV7_BOUND)
    forward = [op for op in launched if op != "fused_fwd"]  # no-grad: the staged forward here
    assert "intra_fwd" in forward and "state_fwd" in forward
    assert step("split") == sorted(stages + forward)


def test_a_wrong_launch_is_named():
    """The checks fail where the real launch would: each with the parameter's name."""
    factory, config = kernels.pipeline(64, 64, 64, torch.bfloat16, torch.float32,
                                       RWKV7_BOUND)["wy_fwd"]
    from csrc_tl import trace
    prim_func = trace(factory, **config)
    B, T, H, K, S = 1, 128, 2, 64, 2
    f32, bf16, i32 = torch.float32, torch.bfloat16, torch.int32

    def args(**change):
        named = dict(A_ab=torch.empty(B, T, H, 64, dtype=f32), A_ak=torch.empty(B, T, H, 64, dtype=f32),
                     ag=torch.empty(B, T, H, K, dtype=bf16), v=torch.empty(B, T, H, K, dtype=bf16),
                     start=torch.empty(S, dtype=i32), length=torch.empty(S, dtype=i32),
                     A_inv=torch.empty(B, T, H, 64, dtype=f32), w=torch.empty(B, T, H, K, dtype=bf16),
                     u=torch.empty(B, T, H, K, dtype=bf16))
        named.update(change)
        return list(named.values())

    check_launch(prim_func, args(), "wy_fwd")  # the right launch passes
    with pytest.raises(TypeError, match="9 parameters"):
        check_launch(prim_func, args()[:-1], "wy_fwd")
    with pytest.raises(TypeError, match="ag_handle is bfloat16, got float32"):
        check_launch(prim_func, args(ag=torch.empty(B, T, H, K)), "wy_fwd")
    with pytest.raises(ValueError, match="v_handle dim 1 is T"):
        check_launch(prim_func, args(v=torch.empty(B, T + 1, H, K, dtype=bf16)), "wy_fwd")
    with pytest.raises(ValueError, match="dim 3 is 64"):
        check_launch(prim_func, args(u=torch.empty(B, T, H, 32, dtype=bf16)), "wy_fwd")
    with pytest.raises(ValueError, match="contiguous"):
        check_launch(prim_func, args(w=torch.empty(B, T, K, H, dtype=bf16).transpose(2, 3)),
                     "wy_fwd")
    with pytest.raises(ValueError, match="4 dims"):
        check_launch(prim_func, args(w=torch.empty(B * T, H, K, dtype=bf16)), "wy_fwd")
