"""The call FLA's ``RWKV7Attention`` makes, at the layer benchmark's size, without FLA.

Under ``patch_fla()`` the layer hands ``chunk_rwkv7`` bf16 tensors throughout, the gates
included (``w = -0.6065 sigmoid(.)`` rounded to bf16, most of them close to 0), ``a = -kk``,
``b = kk · iclr`` (``kk`` l2-normalized), ``safe_gate=True``, RWKV-7's ``lower_bound`` and chunk
64, at B8 T4096 H32 D64 in ``benchmarks/layers.py``.  The rest of the suite mostly draws fp32
gates; this file checks that exact call, no-grad (the fused kernel) and training (the stage
kernels): every output and gradient finite and within the suite's bars of the same call with no
bound and no ``safe_gate`` (the exact schemes).  The inputs follow the layer's statistics (RMS
of r 1.3, k 0.4, v 0.8; iclr in (0, 1)).  Skipped without a GPU.
"""
import pytest
import torch

import torch_dplr
from torch_dplr.testing import RWKV7_BOUND, TOLERANCES, forbid_pytorch_stages, rms_ratio

pytestmark = pytest.mark.cuda

B, T, H, D = 8, 4096, 32, 64


def layer_like_inputs(seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def rand(scale=1.0, shift=0.0):
        return torch.randn(B, T, H, D, generator=gen) * scale + shift
    kk = torch.nn.functional.normalize(rand(), dim=-1)
    iclr = torch.sigmoid(rand())
    x = dict(r=rand(1.3), w=RWKV7_BOUND * torch.sigmoid(rand(1.5, -2.5)), k=rand(0.4),
             v=rand(0.8), a=-kk, b=kk * iclr)
    return {n: t.to(torch.bfloat16).cuda() for n, t in x.items()}


def call(x, lower_bound, grad: bool) -> dict:
    leaves = {n: t.clone().requires_grad_(grad) for n, t in x.items()}
    o, _ = torch_dplr.chunk_rwkv7(leaves["r"], leaves["w"], leaves["k"], leaves["v"],
                                  leaves["a"], leaves["b"], scale=1.0,
                                  safe_gate=lower_bound is not None, lower_bound=lower_bound,
                                  chunk_size=64)
    out = {"o": o.detach()}
    if grad:
        do = torch.randn(o.shape, generator=torch.Generator(device="cuda").manual_seed(1),
                         device="cuda").to(o.dtype)
        grads = torch.autograd.grad(o, list(leaves.values()), do)
        out.update({"d" + n: g for n, g in zip(leaves, grads)})
    return out


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "training"])
def test_the_layers_call_is_finite_and_exact(grad):
    x = layer_like_inputs()
    w = x["w"].float()
    assert x["w"].dtype == torch.bfloat16 and -0.61 < w.min() < w.max() < 0
    with forbid_pytorch_stages():
        bounded = call(x, RWKV7_BOUND, grad)
        exact = call(x, None, grad)
    out_tol, grad_tol = TOLERANCES[torch.bfloat16]
    for name, got in bounded.items():
        bad = int((~torch.isfinite(got)).sum())
        assert bad == 0, f"{name}: {bad} non-finite elements with the layer's bound"
        assert torch.isfinite(exact[name]).all(), f"{name}: non-finite without a bound"
        err = rms_ratio(got, exact[name])
        assert err <= (out_tol if name == "o" else grad_tol), f"{name}: {err:.2e}"
