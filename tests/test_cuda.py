"""CUDA tensors: every op runs on the GPU and matches the CPU kernels; the composed op matches
the fp64 oracle at real sizes.  Skipped without a GPU."""
import pytest
import torch

import torch_dplr
from op_samples import backward_samples, forward_samples
from torch_dplr.testing import parity_errors
from test_parity import assert_within

pytestmark = pytest.mark.cuda


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_ops_match_cpu(kind):
    samples = forward_samples("cpu") if kind == "forward" else backward_samples("cpu")
    for name, args in samples:
        op = getattr(torch.ops.dplr, name).default
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        cpu = op(*args)
        gpu = op(*(_to(a, "cuda") for a in args))
        for c, g in zip(cpu, gpu):
            assert g.device.type == "cuda" and g.shape == c.shape and g.dtype == c.dtype
            tol = 2e-2 if c.dtype in (torch.bfloat16, torch.float16) else 1e-4
            torch.testing.assert_close(g.cpu(), c, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_opcheck_cuda(kind):
    samples = forward_samples("cuda") if kind == "forward" else backward_samples("cuda")
    for name, args in samples:
        torch.library.opcheck(getattr(torch.ops.dplr, name).default, args)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("gates", ["rwkv7", "saturated", "unbounded"])
def test_parity_real_size(chunk_size, gates):
    errors = parity_errors(1, 2048, 16, 64, dtype=torch.bfloat16, gates=gates,
                           chunk_size=chunk_size, device="cuda", seed=3,
                           lower_bound=-0.6065 if gates != "unbounded" else None)
    assert_within(errors, torch.bfloat16)


def test_parity_varlen_cuda():
    cu = [0, 1, 700, 701, 2048]
    errors = parity_errors(1, 2048, 16, 64, dtype=torch.bfloat16, chunk_size=64,
                           cu_seqlens=cu, device="cuda")
    assert_within(errors, torch.bfloat16)


def test_compile_fullgraph_cuda():
    from torch_dplr.testing import make_inputs
    inp = make_inputs(2, 300, 4, 64, dtype=torch.bfloat16, device="cuda")
    args = [inp[n] for n in "q k v a b gk".split()]
    fn = torch.compile(torch_dplr.chunk_dplr_delta_rule, fullgraph=True)
    o, _ = fn(*args)
    o_ref, _ = torch_dplr.chunk_dplr_delta_rule(*args)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernels_match_pytorch_kernels(chunk_size, K, dtype):
    """Ops with a TileLang CUDA kernel agree with their PyTorch kernel at real sizes."""
    from torch_dplr.ops import wy
    from torch_dplr.testing import make_inputs, rms_ratio
    inp = make_inputs(2, 1000, 16, K, dtype=dtype, device="cuda")
    cu = torch.empty(0, dtype=torch.int64, device="cuda")
    intra = torch.ops.dplr.chunk_intra_fwd(*(inp[n] for n in "q k a b gk".split()), cu,
                                           K ** -0.5, chunk_size, -0.6065)
    args = (intra[4], intra[3], intra[7], inp["v"], cu, chunk_size)
    got = torch.ops.dplr.chunk_wy_fwd(*args)
    want = wy.chunk_wy_fwd_reference(*args)
    for name, g, w in zip(("A_ab_inv", "w", "u"), got, want):
        assert torch.isfinite(g).all(), name
        assert rms_ratio(g, w) < (1e-5 if g.dtype == torch.float32 else 4e-3), name
